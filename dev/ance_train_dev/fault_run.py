"""A short run of every service as an OS process, for fault tests, and the check that a run
lost nothing.

The run has exactly two checkpoints, 0 and the last step: the trainer waits for the negatives
of checkpoint 0 before its first step, so checkpoint 0's refresh is always under way while the
trainer waits (a fault can be injected into it at a known moment), and no checkpoint can be
superseded: every checkpoint must end with all its shards, its negatives and its evaluation.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ance_train.data.dataset import load_dataset_index
from ance_train.infra.bus import EventBus, Received, WorkQueue
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    Event,
    NegativesReady,
    RunFinished,
    ShardEncoded,
)
from ance_train.protocol.work import CORPUS, QUERIES, RefreshPlan, ShardWork

from ance_train_dev.service_harness import Harness, stop, wait_until

STEPS = 12


def run_sections(run_id: str, data: Path, model: Path, **inference: object) -> dict:
    """Configuration of a two-checkpoint run over the test subset with the tiny model."""
    return {
        "run_id": run_id,
        "data": {"path": str(data), "dev_fraction": 0.2},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 64},
        "training": {"steps": STEPS, "batch_size": 4, "refresh_every": STEPS,
                     "torch_threads": 1},
        "negatives": {"pool": "ann", "per_query": 1, "warmup": "none", "top_k": 20,
                      "wait_for_first": True},
        "inference": {"replicas": 2, "shard_size": 15, "query_shard_size": 20,
                      "batch_size": 16, "claim_timeout_s": 20, "torch_threads": 1,
                      **inference},
        "index": {"eval_depth": 50},
    }


def entry_ms(entry_id: str) -> int:
    """The server time (ms since the epoch) at which a stream entry was added."""
    return int(entry_id.split("-")[0])


@dataclass
class ServiceRun:
    """Trainer, ``replicas`` inferencers and the indexer of a prepared harness, as processes."""

    harness: Harness
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @classmethod
    def start(cls, harness: Harness, replicas: int = 2, indexer: bool = True) -> ServiceRun:
        run = cls(harness)
        if indexer:
            run.spawn("indexer", "indexer")
        for replica in range(replicas):
            run.spawn("inferencer", f"inferencer-{replica}")
        run.spawn("trainer", "trainer")
        return run

    def spawn(self, role: str, instance: str) -> None:
        self.processes[instance] = self.harness.spawn(role, instance)

    def exited(self) -> dict[str, int]:
        """Exit codes of the services that are no longer running."""
        return {name: p.returncode for name, p in self.processes.items()
                if p.poll() is not None}

    def assert_alive(self) -> None:
        """No service has exited, except the trainer with 0 once it finished."""
        dead = {name: code for name, code in self.exited().items()
                if not (name == "trainer" and code == 0)}
        assert not dead, f"services exited: {dead}\n" + "\n".join(
            f"--- {name}\n{self.harness.log(name)[-3000:]}" for name in dead)

    def wait_finished(self, bus: EventBus, timeout_s: float) -> None:
        """Until the trainer finished and the final checkpoint is evaluated; fails early if a
        service dies."""
        final = self.harness.config.training.steps

        def finished() -> bool:
            self.assert_alive()
            done = any(bus.history(RunFinished))
            return done and any(e.step == final for e in bus.history(EvalCompleted))

        wait_until(finished, timeout_s, "the run did not finish", interval_s=0.5)
        assert self.processes["trainer"].wait(timeout=60) == 0

    def stop(self) -> None:
        for process in self.processes.values():
            stop(process)


def refresh_plan(bus: EventBus, step: int) -> RefreshPlan | None:
    """The shard plan announced with checkpoint ``step`` (None before it is published)."""
    for received in bus.history(CheckpointPublished):
        if received.step == step:
            return received.event.plan
    return None


def shards_encoded(bus: EventBus, step: int) -> int:
    return len({(e.event.kind, e.event.shard)
                for e in bus.history(ShardEncoded) if e.step == step})


def wait_mid_refresh(bus: EventBus, step: int, timeout_s: float) -> tuple[int, int]:
    """Wait until checkpoint ``step``'s refresh has encoded some shards but not all; returns
    (encoded, total)."""
    plan = wait_until(lambda: refresh_plan(bus, step), timeout_s,
                      f"checkpoint {step} was not published")
    total = len(plan.expected_keys())
    encoded = wait_until(lambda: shards_encoded(bus, step), timeout_s,
                         f"no shard of checkpoint {step} was encoded", interval_s=0.02)
    assert encoded < total, f"the refresh of {step} finished before the fault ({total} shards)"
    return encoded, total


def first_entry_after(bus: EventBus, event_types: tuple[type[Event], ...], after_ms: int
                      ) -> Received | None:
    """The earliest entry of the given streams added at or after ``after_ms``."""
    later = [e for t in event_types for e in bus.history(t) if entry_ms(e.entry_id) >= after_ms]
    return min(later, key=lambda e: entry_ms(e.entry_id), default=None)


def assert_nothing_lost(harness: Harness, bus: EventBus,
                        encoded_again: frozenset | set = frozenset()) -> dict:
    """Every checkpoint the trainer made was announced, queued, encoded completely (each shard
    once, or again only by a redelivery or, for ``encoded_again``, a second work item),
    indexed and evaluated; returns counts for the report.
    """
    config, store = harness.config, harness.store
    summary = store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == config.training.steps
    checkpoints = summary["checkpoints"]
    assert checkpoints == [0, config.training.steps]

    published = [e.step for e in bus.history(CheckpointPublished)]
    assert set(published) == set(checkpoints), published
    queued = Counter()
    for _, fields in bus.client.xrange(bus.stream(ShardWork)):
        item = json.loads(fields["data"])
        queued[(item["step"], item["kind"], item["shard"])] += 1
    queue = WorkQueue(bus, config.inference.claim_timeout_s)
    assert queue.pending_count() == 0, "every work item must end acknowledged"

    encoded = Counter()
    redelivered = set()
    for event in bus.history(ShardEncoded):
        name = (event.step, event.event.kind, event.event.shard)
        encoded[name] += 1
        if event.event.attempt >= 2:
            redelivered.add(name)
    num_docs = load_dataset_index(harness.root / "cache").num_docs
    for step in checkpoints:
        plan = refresh_plan(bus, step)
        assert plan is not None
        expected = {(step, kind, shard) for kind, ranges in
                    ((CORPUS, plan.corpus_ranges), (QUERIES, plan.query_ranges))
                    for shard in range(len(ranges))}
        assert {k for k in queued if k[0] == step} == expected, f"work items lost for {step}"
        assert {k for k in encoded if k[0] == step} == expected, f"shards missing for {step}"
        for name in expected:
            again = name in redelivered or name in encoded_again
            assert encoded[name] == 1 or (again and encoded[name] == 2), f"{name} encoded twice"
        assert set(store.list(keys.embeddings(step))) == plan.expected_keys()
        ids = [unpack_embeddings(store.get_bytes(key))[0]  # sha256 verified on read
               for key in sorted(plan.expected_keys()) if f"/{CORPUS}-" in key]
        np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(num_docs))
    for event_type in (NegativesReady, EvalCompleted):
        steps = {e.step for e in bus.history(event_type)}
        assert set(checkpoints) <= steps, f"{event_type} missing: {steps}"
    assert any(s["negatives_step"] == 0 for s in summary["swaps"]), summary["swaps"]
    return {"work_items": sum(queued.values()),
            "duplicate_work_items": sum(n - 1 for n in queued.values()),
            "redelivered_shards": len(redelivered),
            "duplicate_events": len(published) - len(set(published))}
