"""End to end with the dataset in a bucket: `ance-train run` (Redis, trainer, inferencer and
indexer as OS processes) with ``data.path: s3://bucket/datasets/scifact/`` and no local copy of
the data anywhere. The launcher validates by streaming the objects, the inferencer encodes
its shards from ranged GETs, the trainer reads its batches' documents by byte range and the
indexer mines BM25 over the corpus in the bucket. The S3 server is moto on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from minio import Minio

from ance_train.config import DataConfig, load_config
from ance_train.data.corpus import Corpus
from ance_train.data.dataset import load_dataset_index
from ance_train.data.formats import DatasetFiles
from ance_train.infra.store import store_from_env
from ance_train.negatives.strategies.bm25 import bm25_negatives
from ance_train.negatives.table import NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.tables import TableId

from ance_train_dev.helpers import write_config

pytestmark = pytest.mark.e2e


def upload_dir(env: dict[str, str], root: Path, bucket: str, prefix: str) -> None:
    client = Minio(env["ANCE_S3_ENDPOINT"], access_key=env["ANCE_S3_ACCESS_KEY"],
                   secret_key=env["ANCE_S3_SECRET_KEY"], secure=False)
    client.make_bucket(bucket)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.fput_object(bucket, prefix + path.relative_to(root).as_posix(), str(path))


def embedded_run(root: Path, run_id: str, data_path: str, s3_env: dict[str, str],
                 tiny_model: Path) -> tuple[Path, Path]:
    """`ance-train run` of a short ANN run (BM25 warm-up); (config path, run directory)."""
    root.mkdir(parents=True, exist_ok=True)
    config_path = write_config(
        root / f"{run_id}.yaml", run_id=run_id, output_dir=str(root / "runs"),
        data={"path": data_path, "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 32, "max_doc_length": 64},
        training={"steps": 8, "batch_size": 8, "refresh_every": 4, "warmup_steps": 2,
                  "learning_rate": 1e-4, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 2, "warmup": "bm25", "top_k": 30},
        inference={"replicas": 1, "shard_size": 100, "query_shard_size": 100,
                   "batch_size": 32, "torch_threads": 1},
        index={"eval_depth": 100},
    )
    env = {**os.environ, **s3_env, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "ance_train.cli", "run", "--config", str(config_path),
         "--max-minutes", "4"], capture_output=True, text=True, env=env, timeout=300)
    run_dir = root / "runs" / run_id
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in (run_dir / "logs").glob("*"))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "dataset: 300 docs" in result.stdout
    return config_path, run_dir


def test_run_with_the_corpus_in_a_bucket(tmp_path: Path, s3_env: dict[str, str],
                                        tiny_model: Path, scifact_subset: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The data goes to the bucket from a copy that is deleted before the run starts.
    copy = shutil.copytree(scifact_subset, tmp_path / "upload")
    upload_dir(s3_env, copy, "corpus-e2e", "datasets/scifact/")
    shutil.rmtree(copy)
    config_path, run_dir = embedded_run(tmp_path / "s3", "s3-corpus",
                                        "s3://corpus-e2e/datasets/scifact", s3_env, tiny_model)
    assert not [p for p in tmp_path.rglob("*") if p.name in ("corpus.jsonl", "queries.jsonl")]
    # The same run over the local copy, for the deterministic part: the BM25 warm-up and the
    # zero-shot refresh (checkpoint 0, the untrained encoder) must be identical.
    local_config_path, local_run_dir = embedded_run(tmp_path / "local", "local-corpus",
                                                    str(scifact_subset), s3_env, tiny_model)

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    config = load_config(config_path)
    store = store_from_env(config.run_id)
    local_store = store_from_env(load_config(local_config_path).run_id)
    dataset = load_dataset_index(run_dir / "cache")

    # What the launcher published is what the local copy validates to.
    assert load_dataset_index(local_run_dir / "cache") == dataset
    for key in (keys.DOC_OFFSETS, keys.DATASET_INDEX):
        assert store.get_bytes(key) == local_store.get_bytes(key)

    # Every refresh encoded every document (the inferencer's ranged reads), through at least
    # one refresh after the zero-shot one.
    steps = sorted(int(k.split("/")[1].removesuffix(".npz")) for k in store.list("negatives")
                   if k.split("/")[1].removesuffix(".npz").isdigit())
    assert steps[0] == 0 and [s for s in steps if s > 0], steps
    for step in steps:
        corpus_keys = [k for k in store.list(keys.embeddings(step)) if "/corpus-" in k]
        ids = np.concatenate([unpack_embeddings(store.get_bytes(k))[0] for k in corpus_keys])
        np.testing.assert_array_equal(np.sort(ids), np.arange(300))

    # Same negatives and metrics as the local-path run where the run is deterministic.
    for table_id in (TableId.bm25(), TableId.ann(0)):
        ours = NegativesTable.from_bytes(store.get_bytes(table_id.key))
        theirs = NegativesTable.from_bytes(local_store.get_bytes(table_id.key))
        np.testing.assert_array_equal(ours.candidates, theirs.candidates)
        assert list(ours.query_ids) == list(theirs.query_ids)
    zero_shot = json.loads(store.get_bytes(keys.eval_report(0)))["metrics"]
    local_zero_shot = json.loads(local_store.get_bytes(keys.eval_report(0)))["metrics"]
    assert zero_shot and zero_shot == local_zero_shot

    # ...and BM25 over the bucket is BM25 over the local corpus, computed here.
    local_cfg = DataConfig(path=str(scifact_subset), dev_fraction=0.2)
    with Corpus(DatasetFiles.resolve(local_cfg), local_run_dir / "cache" / keys.DOC_OFFSETS_FILE,
                "beir") as local_corpus:
        expected = bm25_negatives(local_corpus, dataset, sorted(dataset.train),
                                  config.negatives.bm25.top_k)
    stored = NegativesTable.from_bytes(store.get_bytes(TableId.bm25().key))
    np.testing.assert_array_equal(stored.candidates, expected.candidates)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer"]["finished"] and summary["trainer"]["steps"] == 8
