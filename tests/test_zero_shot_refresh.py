"""Checkpoint 0 (the zero-shot reference) is refreshed even when newer checkpoints overtake it.

With in-batch negatives the trainer never waits for an index, so a fast trainer can publish
checkpoints 0, 3 and 6 before any inferencer or indexer has started. The test produces that
order on purpose: the trainer process runs alone until it has published its last checkpoint,
then one inferencer and the indexer start. Checkpoint 0 must still be encoded, indexed and
evaluated (every run's zero-shot row comes from it), and it must be the first refresh built;
the checkpoint in between (3) must still be skipped, as any overtaken checkpoint is.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol.events import CheckpointPublished, EvalCompleted, ShardEncoded

from ance_train_dev.service_harness import (
    Harness,
    checkpoint_steps,
    stop,
    three_checkpoint_sections,
    wait_until,
)


def test_checkpoint_zero_is_refreshed_after_being_overtaken(tmp_path: Path, redis_server,
                                                            tiny_model, scifact_subset) -> None:
    harness = Harness.prepare(tmp_path, redis_server.url, **three_checkpoint_sections(
        "zero-shot", scifact_subset, tiny_model, {"pool": "in_batch", "warmup": "none"}))
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes = {"trainer": harness.spawn("trainer", "trainer")}
    try:
        wait_until(lambda: 6 in checkpoint_steps(bus, CheckpointPublished), 300,
                   "the trainer never published its last checkpoint")
        assert checkpoint_steps(bus, CheckpointPublished) == [0, 3, 6]
        # Nothing was encoded before the trainer finished.
        assert checkpoint_steps(bus, ShardEncoded) == []
        processes["inferencer"] = harness.spawn("inferencer", "inferencer")
        processes["indexer"] = harness.spawn("indexer", "indexer")
        wait_until(lambda: 6 in checkpoint_steps(bus, EvalCompleted), 300,
                   "the last checkpoint was never indexed")
        for name, process in processes.items():
            assert process.poll() is None or name == "trainer", harness.log(name)
        refreshed = checkpoint_steps(bus, EvalCompleted)
        encoded = Counter(checkpoint_steps(bus, ShardEncoded))
        evaluated = {int(key.rsplit("/", 1)[-1].removesuffix(".json"))
                     for key in harness.store.list("eval")}
    finally:
        for process in processes.values():
            stop(process)

    assert refreshed == [0, 6], refreshed
    assert 0 in evaluated and 6 in evaluated
    assert 3 not in encoded, f"overtaken checkpoint 3 was encoded: {encoded}"
    assert encoded[0] == encoded[6] > 0
