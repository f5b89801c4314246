"""An embedded run with ``store.keep_refreshes: 1`` and ``keep_checkpoints: 1`` ends with the
expected objects only, and reports its store size (Status, summaries). Real services as OS
processes, real Redis, local store, the tiny BERT."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

import ance_train
from ance_train.infra.rpc import fetch_status
from ance_train.infra.store import LocalStore
from ance_train.protocol import keys
from ance_train.protocol.checkpoints import complete_checkpoints
from ance_train.protocol.embeddings import stored_dtype
from ance_train.protocol.selection import DevPoint, best_step
from ance_train.protocol.tables import TableId

pytestmark = pytest.mark.e2e

STEPS, EVERY = 6, 3


def test_a_bounded_run_keeps_the_newest_refresh_and_the_best_checkpoint(
        tmp_path: Path, tiny_model, scifact_subset) -> None:
    config = {
        "run_id": "bounded", "output_dir": str(tmp_path / "runs"),
        "data": {"path": str(scifact_subset), "dev_fraction": 0.2},
        "model": {"path": str(tiny_model), "max_query_length": 32, "max_doc_length": 64},
        "training": {"steps": STEPS, "batch_size": 8, "refresh_every": EVERY,
                     "warmup_steps": 1, "torch_threads": 1},
        "negatives": {"pool": "ann", "warmup": "bm25", "top_k": 20},
        "inference": {"replicas": 1, "shard_size": 100, "batch_size": 16, "torch_threads": 1},
        "index": {"eval_depth": 50},
        "store": {"keep_refreshes": 1, "keep_checkpoints": 1},
    }
    run = ance_train.Run(config, max_minutes=6)
    sizes: list[int] = []
    with run:
        for refresh in run.refreshes():
            if refresh.step > 0:
                for child in (run._run.trainer, run._run.indexer):
                    # The trainer may have finished: its server is gone.
                    with contextlib.suppress(Exception):
                        sizes.append(fetch_status(child.address, timeout_s=2).store_bytes)
        ended = time.monotonic()
    # The iteration's end stopped the run; leaving the block must not stop it again (a second
    # final sweep found Redis stopped and retried it for 80 s before giving up).
    assert time.monotonic() - ended < 5
    steps = [r.step for r in run.evaluations]
    assert steps[0] == 0 and steps[-1] == STEPS, steps
    assert max(sizes, default=-1) > 0, sizes  # Status carried the run's store size

    store = LocalStore("bounded", run.run_dir / "store")
    left = store.list()
    refreshes = {keys.refresh_step(k) for k in left} - {None}
    assert refreshes == {STEPS}, sorted(left)  # only the newest refresh's objects
    assert TableId.ann(STEPS).key in left and TableId.bm25().key in left
    shards = store.list(keys.embeddings(STEPS))
    assert shards and all(stored_dtype(store.get_bytes(k)) == "float16" for k in shards)
    # Checkpoints: the newest (resume, served index) and the best on dev nDCG@10, the earliest
    # of equals as export picks it (the tiny model's dev values often tie).
    best = best_step([DevPoint(r.step, r.metrics["dev"]["ndcg@10"]) for r in run.evaluations])
    checkpoint_dirs = {keys.checkpoint_step(k) for k in store.list(keys.CHECKPOINTS)}
    assert complete_checkpoints(left) == sorted({STEPS, best})
    assert checkpoint_dirs == {STEPS, best}  # nothing of a deleted one is left
    # Every evaluation report, the dataset index and the summary stay.
    assert {keys.eval_report(s) for s in steps} <= set(left)
    assert {keys.DATASET_INDEX, keys.DOC_OFFSETS, keys.TRAINER_SUMMARY} <= set(left)
    only = {keys.DATASET_INDEX, keys.DOC_OFFSETS, keys.TRAINER_SUMMARY, keys.RUN_CONFIG,
            TableId.bm25().key, *(keys.eval_report(s) for s in steps)}
    others = [k for k in left if k not in only and keys.refresh_step(k) != STEPS
              and keys.checkpoint_step(k) not in (STEPS, best)]
    assert others == [], others

    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["store_bytes"] == store.usage() > 0
    assert summary["trainer"]["store_bytes"] > 0
    # Sanity of the export path on what is left: the best checkpoint is still exportable.
    assert run.export("best").is_dir()
