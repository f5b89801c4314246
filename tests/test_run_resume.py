"""``ance-train run --resume RUN_DIR``: an embedded run whose launcher was SIGKILLed after its
first checkpoint continues from its newest complete checkpoint, keeping what it produced.

A real run (the CLI, redis-server, trainer, indexer, inferencer as OS processes, local store,
the tiny BERT on the SciFact subset) is killed with its launcher's process group; the
services die with it (PDEATHSIG). The resumed run must finish with every step recorded once,
the checkpoints and negatives tables announced before the kill byte for byte unchanged, and
the final metrics written. Refusals (a changed config, a missing run) touch nothing.

The run indexes MaxP passages (``data.passages.mode: max``): the resume guarantee holds with
passages, and the passage ids survive the restart (the tables made before the kill, which
name each negative's passage, are unchanged, and those made after it name passages too).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import dump_config, load_config
from ance_train.infra.bus import EventBus, connect
from ance_train.infra.store import LocalStore
from ance_train.launcher.embedded import RESUME_SAFE_FIELDS, resume_conflicts
from ance_train.negatives.table import NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, NegativesReady
from ance_train.trainer.checkpoints import latest_complete_checkpoint

from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import processes_mentioning, wait_until

STEPS, REFRESH = 60, 10  # 50 steps after the first checkpoint for the kill to land in
RUN_ID = "resumed"


def _config(root: Path, data: Path, model: Path) -> dict:
    return {"run_id": RUN_ID, "output_dir": str(root / "runs"),
            "data": {"path": str(data), "dev_fraction": 0.2,
                     "passages": {"mode": "max", "max_passages": 2}},
            "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32},
            "training": {"steps": STEPS, "batch_size": 8, "refresh_every": REFRESH,
                         "warmup_steps": 2, "learning_rate": 1e-4, "torch_threads": 1},
            "negatives": {"pool": "ann", "per_query": 1, "warmup": "none", "top_k": 20},
            "inference": {"replicas": 1, "shard_size": 100, "claim_timeout_s": 10,
                          "torch_threads": 1},
            "index": {"eval_depth": 50}}


def _launch(*args: str) -> subprocess.Popen:
    env = dict(os.environ, ANCE_TERMINATION_GRACE_S="5")  # orphans stop within 5 s
    return subprocess.Popen([sys.executable, "-m", "ance_train.cli", "run", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _bus(run_dir: Path) -> EventBus | None:
    try:
        url = json.loads((run_dir / "endpoints.json").read_text())["redis_url"]
    except (OSError, ValueError, KeyError):
        return None
    return EventBus(connect(url), RUN_ID)


def _hashes(store_root: Path, prefixes: list[str]) -> dict[str, str]:
    files = [p for prefix in prefixes for p in sorted((store_root / prefix).rglob("*"))
             if p.is_file()]
    files += [store_root / prefix for prefix in prefixes if (store_root / prefix).is_file()]
    return {str(p.relative_to(store_root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


@pytest.mark.e2e
def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path: Path, scifact_subset,
                                                       tiny_model) -> None:
    config_path = write_config(tmp_path / "c.yaml", **_config(tmp_path, scifact_subset,
                                                              tiny_model))
    run_dir = tmp_path / "runs" / RUN_ID
    launcher = _launch("--config", str(config_path))
    try:
        def past_first_checkpoint() -> tuple[list[int], list] | None:
            bus = _bus(run_dir)
            try:
                published = [e.step for e in bus.history(CheckpointPublished)] if bus else []
                if not any(step >= REFRESH for step in published):
                    return None
                # Its training state, stored after the announcement, too.
                complete = latest_complete_checkpoint(LocalStore(RUN_ID, run_dir / "store"))
                if complete is None or complete < REFRESH:
                    return None
                return published, [r.event for r in bus.history(NegativesReady)]
            except Exception:  # Redis not up yet
                return None

        published, ready = wait_until(past_first_checkpoint, 300,
                                      "the run never published its first checkpoint",
                                      interval_s=0.1)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's process group, no warning
        launcher.communicate(timeout=60)
    wait_until(lambda: not processes_mentioning(str(run_dir)), 60,
               "services outlived their killed launcher")

    store = LocalStore(RUN_ID, run_dir / "store")
    store_root = run_dir / "store" / RUN_ID
    assert not store.exists(keys.TRAINER_SUMMARY) or not store.get_json(
        keys.TRAINER_SUMMARY)["finished"], "the run finished before the kill: nothing to test"
    tables = [table.key for event in ready for table in event.tables]
    assert tables, "no negatives table was announced before the kill"
    before = _hashes(store_root, [keys.checkpoint(step) for step in published] + tables)
    assert any(name.startswith(f"{keys.checkpoint(REFRESH)}/") for name in before)
    assert not (run_dir / "summary.json").exists()

    resumed = _launch("--resume", str(run_dir))
    try:
        stdout, stderr = resumed.communicate(timeout=420)
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    assert resumed.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"

    after = _hashes(store_root, [keys.checkpoint(step) for step in published] + tables)
    assert after == before, "a checkpoint or table made before the kill was changed"
    summary = store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == STEPS
    [resumed_from] = summary["resumed_from"]
    assert REFRESH <= resumed_from < STEPS
    for name in ("losses", "async_gaps", "negatives_steps", "step_seconds"):
        assert len(summary[name]) == STEPS, name  # one entry per step: none twice or missing
    assert summary["checkpoints"] == load_config(config_path).training.checkpoint_steps()
    swaps = [swap["step"] for swap in summary["swaps"]]
    assert swaps == sorted(set(swaps)), "swap records repeated or out of order"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"resuming from checkpoint {resumed_from}" in trainer_log

    run_summary = json.loads((run_dir / "summary.json").read_text())
    evaluated = [e["step"] for e in run_summary["evaluations"]]
    assert evaluated == sorted(set(evaluated)) and evaluated[0] == 0 and evaluated[-1] == STEPS
    assert run_summary["trainer"]["steps"] == STEPS
    final = store.get_json(keys.eval_report(STEPS))
    assert final["metrics"]["dev"]["ndcg@10"] >= 0.0
    # Passages across the restart: every table names a passage per negative and positive
    # (some beyond the first), before the kill and after it.
    announced = sorted(store.list(f"{keys.NEGATIVES}/"))
    assert set(tables) < set(announced)
    for key in announced:
        table = NegativesTable.from_bytes(store.get_bytes(key))
        assert table.passages is not None and table.positive_passages is not None, key
        assert set(np.unique(table.passages[table.candidates >= 0])) <= {0, 1}
    assert any((NegativesTable.from_bytes(store.get_bytes(key)).passages == 1).any()
               for key in announced)
    assert "final" in stdout  # the zero-shot → final table of the run's end
    assert not processes_mentioning(str(run_dir))

    # A finished run is not resumed again, and nothing of it changes.
    again = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--resume",
                            str(run_dir)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "already finished" in again.stderr
    assert _hashes(store_root, [keys.checkpoint(step) for step in published] + tables) == before


def test_resume_refuses_a_changed_configuration(tmp_path: Path, scifact_subset,
                                                tiny_model) -> None:
    """Any field but where and how fast processes run is refused, naming it, before anything
    is touched; safe fields may change."""
    raw = _config(tmp_path, scifact_subset, tiny_model)
    stored = load_config(write_config(tmp_path / "stored.yaml", **raw))
    run_dir = tmp_path / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(stored))
    (run_dir / "precious.txt").write_text("kept")

    changed = write_config(tmp_path / "changed.yaml", **raw)
    result = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--resume",
                             str(run_dir), "--config", str(changed), "--set",
                             "negatives.top_k=30"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "negatives.top_k: 20 → 30" in result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "precious.txt"]

    safe = load_config(changed, ["inference.replicas=3", "services.restart.max_restarts=9",
                                 "training.torch_threads=2",
                                 "inference.reuse_between_refreshes=false",
                                 "inference.token_cache_mb=0"])
    assert resume_conflicts(stored, safe) == []
    unsafe = load_config(changed, ["training.steps=80", "model.max_doc_length=64"])
    assert [c.split(":")[0] for c in resume_conflicts(stored, unsafe)] == [
        "model.max_doc_length", "training.steps"]
    assert "inference.replicas" in RESUME_SAFE_FIELDS

    missing = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--resume",
                              str(tmp_path / "nothing")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 1 and "holds no embedded run" in missing.stderr
    both = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--resume",
                           str(run_dir), "--overwrite"], capture_output=True, text=True,
                          timeout=120)
    assert both.returncode == 2 and (run_dir / "precious.txt").exists()
