"""The two runs of a partition-equality test: a reference run (trainer, inferencer, one indexer,
every service an OS process) and its refreshes replayed to P index partitions, which get
exactly the reference's stored embedding shards and its ``checkpoint.published`` events, one
refresh at a time (the trainer and inferencer are not started again, so both runs index the
same vectors)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, EvalCompleted, NegativesReady

from ance_train_dev.service_harness import (
    Harness,
    checkpoint_steps,
    stop,
    wait_registered,
    wait_until,
)


@dataclasses.dataclass
class Run:
    harness: Harness
    bus: EventBus
    processes: list
    built: list[int]


@contextmanager
def reference_run(root: Path, redis_url: str, sections: dict, last_step: int) -> Iterator[Run]:
    """Trainer, inferencer and one indexer until ``last_step`` is evaluated; the indexer
    stays up for Search until the context ends."""
    harness = Harness.prepare(root, redis_url, **sections)
    bus = EventBus(connect(redis_url), harness.config.run_id)
    processes = [harness.spawn("indexer", "indexer"), harness.spawn("inferencer", "inferencer")]
    trainer = harness.spawn("trainer", "trainer")
    processes.append(trainer)
    try:
        assert trainer.wait(timeout=400) == 0, harness.log("trainer")[-3000:]
        wait_until(lambda: last_step in checkpoint_steps(bus, EvalCompleted), 300,
                   f"the reference indexer never evaluated checkpoint {last_step}")
        stop(processes[1])  # the inferencer is done
        built = checkpoint_steps(bus, NegativesReady)
        assert built[0] == 0 and built[-1] == last_step, built
        yield Run(harness, bus, processes, built)
    finally:
        for process in processes:
            stop(process)


@contextmanager
def partitioned_replay(root: Path, redis_url: str, sections: dict, reference: Run,
                       partitions: int = 2) -> Iterator[Run]:
    """``partitions`` fresh indexer processes fed ``reference``'s stored shards (and its last
    checkpoint, which Search encodes query texts with), one refresh at a time."""
    harness = Harness.prepare(root, redis_url, **sections)
    bus = EventBus(connect(redis_url), harness.config.run_id)
    source, target = reference.harness.store, harness.store
    for step in reference.built:
        copied = source.list(keys.embeddings(step))
        if step == reference.built[-1]:
            copied += source.list(keys.checkpoint(step))
        for key in copied:
            target.put_bytes(key, source.get_bytes(key))
    processes = [harness.spawn("indexer", f"indexer-{p}", {"ANCE_INDEX_PARTITION": str(p)})
                 for p in range(partitions)]
    try:
        for p, process in enumerate(processes):
            wait_registered(harness, bus, process, "indexer", f"indexer-{p}")
        published = {r.event.step: r.event for r in reference.bus.history(CheckpointPublished)}
        for step in reference.built:
            bus.publish(published[step])
            wait_until(lambda s=step: s in checkpoint_steps(bus, EvalCompleted)
                       or any(p.poll() is not None for p in processes), 240,
                       f"the partitions never announced checkpoint {step}")
            assert all(p.poll() is None for p in processes), harness.log("indexer-0")[-3000:]
        yield Run(harness, bus, processes, reference.built)
    finally:
        for process in processes:
            stop(process)
