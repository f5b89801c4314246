"""`ance-train run` with ``index.partitions: 2``: the embedded launcher starts two indexer
processes (one per partition), the run completes, and each refresh is announced once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ance_train_dev.helpers import write_config


def test_embedded_run_with_two_index_partitions(tmp_path: Path, scifact_subset,
                                                tiny_model) -> None:
    config = write_config(
        tmp_path / "c.yaml", run_id="partitions", output_dir=str(tmp_path / "runs"),
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": 3, "batch_size": 4, "refresh_every": 3, "torch_threads": 1},
        negatives={"pool": "ann", "warmup": "none", "top_k": 20},
        inference={"replicas": 1, "shard_size": 100, "torch_threads": 1},
        index={"eval_depth": 100, "partitions": 2})
    result = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--config",
                             str(config)], capture_output=True, text=True, timeout=400)
    run_dir = tmp_path / "runs" / "partitions"
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == [0, 3], "each refresh once"
    logs = {p: (run_dir / "logs" / f"indexer-{p}.log").read_text() for p in (0, 1)}
    assert not (run_dir / "logs" / "indexer.log").exists()
    for step in (0, 3):
        for partition, log in logs.items():
            assert f"checkpoint {step}: partition {partition} of 2 searched" in log
        assert f"checkpoint {step} indexed" in logs[0]
        assert f"checkpoint {step} indexed" not in logs[1]
        # ANCE mines from the merged lists and the positives' vectors the partitions sent:
        # partition 0 reads no corpus shard back.
        assert f"checkpoint {step}: merged 2 partitions' lists (0 corpus shards read" in logs[0]
    # The 300 documents are cut into 3 shards: partition 0 owns shards 0 and 2, partition 1
    # shard 1 (protocol/work.py, partition_of: shard mod partitions).
    assert "(200 documents" in logs[0] and "(100 documents" in logs[1]
