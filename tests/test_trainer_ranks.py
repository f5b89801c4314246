"""The real Trainer on two data-parallel ranks, started as ``ance-train run`` starts it
(``python -m torch.distributed.run --nproc-per-node 2 -m ance_train.cli serve trainer``,
gloo on 127.0.0.1), against a real Redis and a local store; the reference is one Trainer
process on the same global batch. Rank 0 alone checkpoints, announces and writes the summary;
rank 1 trains on the batches rank 0 sends. Also: ``ance-train run`` with two trainer
processes, end to end. Dropout is 0 (the two sides encode different row
sets per forward); tolerances as in tests/test_distributed.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.embedded import RANKS_ENV, service_command
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished
from ance_train.runtime import ServiceOptions, connect_context
from ance_train.trainer.trainer import Trainer

from ance_train_dev.distributed_world import make_model
from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import Harness, processes_mentioning

STEPS = 5
EVERY = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


def _prepare(root: Path, run_id: str, redis_url: str, model_dir: Path, data: Path,
             processes: int) -> Harness:
    root.mkdir()
    return Harness.prepare(
        root, redis_url, run_id=run_id, data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(model_dir), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": STEPS, "batch_size": 8, "refresh_every": EVERY, "warmup_steps": 1,
                  "learning_rate": 1e-3, "torch_threads": 1, "mixed_precision": "off",
                  "processes": processes},
        negatives={"pool": "random", "per_query": 2, "warmup": "none"},
    )


def _launch(harness: Harness) -> None:
    """The trainer on two ranks, as ``ance-train run`` starts it."""
    launch = service_command("trainer", 2)
    command = [*launch.argv, "serve", "trainer",
               "--config", str(harness.config_path), "--instance", "trainer",
               "--work-dir", str(harness.root / "work")]
    done = subprocess.run(command, env={**harness.env(), **launch.env}, capture_output=True,
                          text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _weights(harness: Harness, name: str = "final") -> dict[str, torch.Tensor]:
    target = harness.root / name
    harness.store.get_dir(keys.checkpoint(STEPS), target)
    return load_file(str(target / "model.safetensors"))


def test_two_trainer_ranks_train_like_one_trainer(tmp_path: Path, redis_server, model_dir: Path,
                                                  scifact_subset: Path) -> None:
    one = _prepare(tmp_path / "one", "one", redis_server.url, model_dir, scifact_subset, 1)
    context = connect_context(ServiceOptions(
        role="trainer", config_path=str(one.config_path), redis_url=one.redis_url,
        work_dir=str(one.root / "work"), instance="trainer", store_dir=str(one.root / "store")))
    reference = Trainer(context).run()

    two = _prepare(tmp_path / "two", "two", redis_server.url, model_dir, scifact_subset, 2)
    _launch(two)

    summary = two.store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == STEPS
    assert summary["losses"] == pytest.approx(reference.losses, rel=1e-5)
    assert summary["checkpoints"] == [0, EVERY, STEPS]
    published = [e.step for e in EventBus(connect(redis_server.url), "two")
                 .history(CheckpointPublished)]
    assert published == [0, EVERY, STEPS]  # once each: rank 0 alone announces
    assert (two.root / "work" / "rank-1").is_dir()  # rank 1 kept its files apart
    assert not (two.root / "work" / "rank-1" / "checkpoints").exists()
    want, got = _weights(one), _weights(two)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_two_ranks_resume_exactly(tmp_path: Path, redis_server, tmp_path_factory,
                                  scifact_subset: Path) -> None:
    """With dropout: run A trains 5 steps on two ranks (checkpoints 0, 3, 5). Run B holds A's
    store up to checkpoint 3 only; its two ranks resume there — rank 1 with its own RNG state
    from the checkpoint — and must end on A's weights and losses bit for bit."""
    dropout = make_model(tmp_path_factory.mktemp("tiny-bert-dropout"), dropout=0.1)
    a = _prepare(tmp_path / "a", "resume-a", redis_server.url, dropout, scifact_subset, 2)
    _launch(a)
    straight = a.store.get_json(keys.TRAINER_SUMMARY)
    assert straight["checkpoints"] == [0, EVERY, STEPS]

    b = _prepare(tmp_path / "b", "resume-b", redis_server.url, dropout, scifact_subset, 2)
    for step in (0, EVERY):
        a.store.get_dir(keys.checkpoint(step), tmp_path / f"ckpt-{step}")
        b.store.put_dir(keys.checkpoint(step), tmp_path / f"ckpt-{step}")
    _launch(b)
    resumed = b.store.get_json(keys.TRAINER_SUMMARY)
    assert resumed["resumed_from"] == [EVERY]
    assert resumed["losses"] == straight["losses"]
    want, got = _weights(a), _weights(b)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_embedded_run_with_two_trainer_processes(tmp_path: Path, scifact_subset: Path,
                                                 tiny_model: Path) -> None:
    """``ance-train run`` with ``training.processes: 2`` (and GradCache, dropout on): the
    trainer ranks, the indexer and an inferencer finish a run whose ANN negatives are swapped
    in while it trains, and leave no process behind."""
    config = {"run_id": "ranks", "output_dir": str(tmp_path / "runs"),
              "data": {"path": str(scifact_subset)},
              "model": {"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
              "training": {"steps": 12, "batch_size": 8, "refresh_every": 4, "warmup_steps": 1,
                           "torch_threads": 1, "processes": 2, "grad_cache_chunk": 3},
              "negatives": {"warmup": "none"},
              "inference": {"replicas": 1, "shard_size": 200, "torch_threads": 1}}
    path = write_config(tmp_path / "c.yaml", **config)
    done = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--config", str(path)],
                          capture_output=True, text=True, timeout=400)
    run_dir = tmp_path / "runs" / "ranks"
    assert done.returncode == 0, done.stderr[-3000:]
    trainer = json.loads((run_dir / "summary.json").read_text())["trainer"]
    assert trainer["finished"] and trainer["steps"] == 12
    assert trainer["checkpoints"] == [0, 4, 8, 12]
    first = trainer["swaps"][0]  # ANN from checkpoint 0 (with the timeline's times besides)
    assert (first["step"], first["negatives_step"]) == (1, 0)
    assert all(math.isfinite(loss) for loss in trainer["losses"])
    assert (run_dir / "work" / "trainer" / "rank-1").is_dir()
    log = (run_dir / "logs" / "trainer.log").read_text()
    # The finished trainer exited by itself (a signalled torchrun logs a SignalException),
    # and every line of its ranks names the rank.
    assert "SignalException" not in log and "trainer[trainer rank 1/2]" in log
    time.sleep(0.5)
    assert processes_mentioning(str(run_dir)) == [], "a trainer rank outlived the run"


def test_service_command_starts_trainer_ranks_through_torchrun() -> None:
    assert service_command("trainer", 1) == ([sys.executable, "-m", "ance_train.cli"], {})
    assert service_command("indexer", 4) == ([sys.executable, "-m", "ance_train.cli"], {})
    command, env = service_command("trainer", 3)
    assert env == RANKS_ENV  # torchrun's restarts need it: it comes with the command
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[command.index("--nproc-per-node") + 1] == "3"
    assert command[command.index("--rdzv-backend") + 1] == "c10d"
    assert command[command.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert command[command.index("--max-restarts") + 1] == "3"  # training.max_restarts
    assert service_command("trainer", 2, 0).argv[command.index("--max-restarts") + 1] == "0"
    assert command[-2:] == ["-m", "ance_train.cli"]
