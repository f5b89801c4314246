"""The refresh timeline (issue 31) assembled from the events' times: rows in pipeline order,
waits as the gaps between roles, the fixed part, and events of older writers still parse."""

from __future__ import annotations

import pytest

from ance_train.observability.timeline import (
    PHASE_NAMES,
    check_order,
    refresh_timeline,
    scalars,
    union_seconds,
    with_swap,
)
from ance_train.protocol import keys
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    IndexerTimes,
    ShardEncoded,
)
from ance_train.protocol.work import CORPUS, QUERIES, RefreshPlan

PLAN = RefreshPlan(step=3, corpus_ranges=((0, 10), (10, 20)), query_ranges=((0, 4),))
PUBLISHED = CheckpointPublished(step=3, key=keys.checkpoint(3), plan=PLAN, save_started_at=100.0,
                                saved_at=100.5, upload_started_at=100.6, uploaded_at=101.0,
                                published_at=101.1)


def shard(kind, number: int, start: float, instance: str) -> ShardEncoded:
    """A shard claimed at ``start``: load 0.1, tokenize 0.1, encode 1.0, wait 0.1, upload 0.1."""
    return ShardEncoded(step=3, kind=kind, shard=number, key=keys.embedding_shard(3, kind, number),
                        count=10, instance=instance, attempt=1, claimed_at=start,
                        loaded_at=start + 0.1, tokenized_at=start + 0.2, encoded_at=start + 1.2,
                        upload_started_at=start + 1.3, finished_at=start + 1.4, seconds=1.3)


SHARDS = [shard(CORPUS, 0, 101.2, "a"), shard(CORPUS, 1, 101.3, "b"),
          shard(QUERIES, 0, 102.5, "a")]
TIMES = IndexerTimes(complete_at=104.0, build_started_at=104.0, built_at=104.2,
                     searched_at=104.3, mined_at=104.5, evaluated_at=104.8, eval_search_s=0.1,
                     announced_at=104.9)


def test_rows_in_pipeline_order_with_the_waits_as_gaps() -> None:
    timeline = refresh_timeline(PUBLISHED, SHARDS, TIMES)
    rows = {r["phase"]: r for r in timeline["rows"]}
    assert check_order(timeline) == []
    assert rows["wait: save → upload"]["seconds"] == pytest.approx(0.1)
    assert rows["wait: published → first shard claimed"]["seconds"] == pytest.approx(0.1)
    assert rows["encode"]["start"] == 101.4 and rows["encode"]["end"] == pytest.approx(103.7)
    assert rows["encode"]["busy_s"] == pytest.approx(3.0)
    assert rows["wait: last shard in → index build"]["start"] == pytest.approx(103.9)
    # Encoding of corpus shards 0 and 1 overlaps: union 101.4–102.5, then the query shard.
    assert timeline["encode_union_s"] == pytest.approx(1.1 + 1.0)
    assert timeline["search_s"] == pytest.approx(0.2)

    done = with_swap(timeline, {"received_at": 105.0, "held_at": 105.2, "used_at": 107.0})
    assert [r["phase"] for r in done["rows"]] == list(PHASE_NAMES)
    assert check_order(done) == [] and done["swapped"]
    assert done["period_s"] == pytest.approx(5.2)
    assert done["fixed_s"] == pytest.approx(5.2 - 2.1 - 0.2)
    assert scalars(done)["timeline/fixed_s"] == pytest.approx(done["fixed_s"])
    assert scalars(done)["timeline/wait_ready_to_trainer_reads_it_s"] == pytest.approx(0.1)

    final = with_swap(timeline, None)  # the trainer had finished: ends at negatives.ready
    assert final["rows"][-1]["phase"] == "negatives.ready" and not final["swapped"]
    assert final["period_s"] == pytest.approx(4.9)


def test_out_of_order_and_missing_parts_are_named() -> None:
    late = PUBLISHED.model_copy(update={"published_at": 101.25})  # after the first claim
    problems = check_order(refresh_timeline(late, SHARDS, TIMES))
    assert any("wait: published → first shard claimed" in p for p in problems)
    with pytest.raises(ValueError, match=r"no shard\.encoded"):
        refresh_timeline(PUBLISHED, SHARDS[:2], TIMES)
    with pytest.raises(ValueError, match="has no timeline"):
        refresh_timeline(CheckpointPublished(step=3, key="k", plan=PLAN), SHARDS, TIMES)


def test_union_of_intervals() -> None:
    assert union_seconds([]) == 0
    assert union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)


def test_events_without_times_still_parse_and_with_them_round_trip() -> None:
    old = ShardEncoded(step=3, kind=CORPUS, shard=0, key="k", count=1, instance="a", attempt=1,
                       finished_at=1.0, seconds=1.0)
    assert old.claimed_at is None and old.model_reloaded is None
    for event in (*SHARDS, PUBLISHED,
                  EvalCompleted(step=3, key="eval/3.json", metrics={}, times=TIMES)):
        assert type(event).decode(event.encode()) == event
    assert EvalCompleted.decode(EvalCompleted(step=3, key="k", metrics={}).encode()).times is None
