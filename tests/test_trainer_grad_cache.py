"""The real Trainer (Redis, local store) with ``training.grad_cache_chunk``: its step goes
through the same loss as the plain step (trainer/step.py), so a run with GradCache trains
like one without. Dropout is 0 so that chunked and whole-batch encodings coincide."""

from __future__ import annotations

from pathlib import Path

import pytest

from ance_train.runtime import ServiceOptions, connect_context
from ance_train.trainer.trainer import Trainer

from ance_train_dev.distributed_world import make_model
from ance_train_dev.service_harness import Harness

STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


def _run(root: Path, run_id: str, redis_url: str, model_dir: Path, data: Path,
         chunk: int | None) -> list[float]:
    root.mkdir()
    harness = Harness.prepare(
        root, redis_url, run_id=run_id, data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(model_dir), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": STEPS, "batch_size": 6, "refresh_every": STEPS, "warmup_steps": 1,
                  "learning_rate": 1e-3, "torch_threads": 1, "mixed_precision": "off",
                  "grad_cache_chunk": chunk},
        negatives={"pool": "random", "per_query": 2, "warmup": "none"},
    )
    context = connect_context(ServiceOptions(
        role="trainer", config_path=str(harness.config_path), redis_url=harness.redis_url,
        work_dir=str(root / "work"), instance="trainer", store_dir=str(root / "store")))
    return Trainer(context).run().losses


def test_trainer_with_grad_cache_trains_like_without(tmp_path: Path, redis_server,
                                                     model_dir: Path,
                                                     scifact_subset: Path) -> None:
    plain = _run(tmp_path / "plain", "plain", redis_server.url, model_dir, scifact_subset, None)
    cached = _run(tmp_path / "cached", "cached", redis_server.url, model_dir, scifact_subset, 2)
    assert len(plain) == len(cached) == STEPS
    assert cached == pytest.approx(plain, rel=1e-5)
    assert plain[0] != plain[-1]
