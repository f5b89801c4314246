"""The refresh timeline: when each phase of one checkpoint's refresh started and ended, in
every role, with the waits between the roles as rows of their own.

One clock domain: every time is Unix wall-clock time (``time.time()``) taken by the process
that did the work. The processes of an embedded run share one clock; pods of a cluster share
it to within NTP's accuracy (typically well under a millisecond to a few milliseconds on one
network), which bounds the error of a wait between two roles.

The times travel with what the services already exchange:

- save, upload, announce: the trainer (:mod:`ance_train.trainer.checkpoints`), in
  ``checkpoint.published`` (``save_started_at`` … ``published_at``): the model's files, what
  the announcement waits for (the training state is saved and uploaded after it);
- model load, tokenize, encode, shard upload, per shard: the inferencer, in ``shard.encoded``
  (``claimed_at`` … ``finished_at``);
- index build, search, mining, evaluation, negatives.ready: the indexer, in
  ``eval.completed`` (``times``) and ``eval/<k>.json``;
- swap (read the event, download and open the table) and the first step on it: the
  trainer's feed and loop, in ``trainer/summary.json`` (``swaps``).

The indexer, which reads every event of a refresh, assembles the rows up to
``negatives.ready`` (:func:`refresh_timeline`) and stores them in the refresh's evaluation
report (``timeline``) and as TensorBoard scalars (:func:`scalars`); the trainer adds its swap
rows (:func:`with_swap`, :func:`swap_scalars`). :func:`run_timelines` joins both after a run
from the store alone.

Inferencer rows aggregate every shard of the refresh: ``start`` is the first shard's, ``end``
the last shard's, ``busy_s`` the sum over shards (replicas work in parallel, so it can exceed
``seconds``). ``fixed_s`` is the refresh (trainer's save → table swapped in) minus the time
during which some replica was encoding (the union of the shards' encode intervals) and minus
the index searches: what a refresh costs beyond the work proportional to the corpus.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any, cast

from ance_train.protocol.events import CheckpointPublished, IndexerTimes, ShardEncoded

# Pipeline order: (row, role). Rows whose role is "wait" are gaps between two roles.
PHASES: tuple[tuple[str, str], ...] = (
    ("save", "trainer"),
    ("wait: save → upload", "wait"),
    ("upload", "trainer"),
    ("announce", "trainer"),
    ("wait: published → first shard claimed", "wait"),
    ("model load", "inferencer"),
    ("tokenize", "inferencer"),
    ("encode", "inferencer"),
    ("shard upload", "inferencer"),
    ("wait: last shard in → index build", "wait"),
    ("index build", "indexer"),
    ("search", "indexer"),
    ("mining", "indexer"),
    ("evaluation", "indexer"),
    ("negatives.ready", "indexer"),
    ("wait: ready → trainer reads it", "wait"),
    ("swap", "trainer"),
    ("wait: swapped in → first step on it", "wait"),
)
PHASE_NAMES = tuple(name for name, _ in PHASES)
INDEXER_PHASES = PHASE_NAMES[:PHASE_NAMES.index("negatives.ready") + 1]
SWAP_PHASES = PHASE_NAMES[len(INDEXER_PHASES):]


def _row(name: str, start: float, end: float, **extra: Any) -> dict:
    role = dict(PHASES)[name]
    return {"phase": name, "role": role, "start": start, "end": end,
            "seconds": end - start, **extra}


def _span(shards: list[ShardEncoded], start: str, end: str) -> tuple[float, float, float]:
    """First start, last end and summed duration of one per-shard phase."""
    pairs = [(getattr(s, start), getattr(s, end)) for s in shards]
    return (min(a for a, _ in pairs), max(b for _, b in pairs),
            sum(b - a for a, b in pairs))


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def recorded(shard: ShardEncoded) -> bool:
    """Whether ``shard`` carries its timeline (a replica of this version sent it)."""
    return None not in (shard.claimed_at, shard.loaded_at, shard.tokenized_at,
                        shard.encoded_at, shard.upload_started_at)


def refresh_timeline(published: CheckpointPublished, shards: Iterable[ShardEncoded],
                     times: IndexerTimes) -> dict:
    """The rows of checkpoint ``published.step``'s refresh up to ``negatives.ready``, from
    its ``checkpoint.published``, the ``shard.encoded`` of every shard of its plan and the
    indexer's times. Raises ValueError when a part of it was not recorded."""
    p = published
    if (p.save_started_at is None or p.saved_at is None or p.upload_started_at is None
            or p.uploaded_at is None or p.published_at is None):
        raise ValueError(f"checkpoint {p.step}: its checkpoint.published has no timeline")
    by_key = {s.key: s for s in shards if s.step == p.step}
    missing = p.plan.expected_keys() - set(by_key)
    if missing:
        raise ValueError(f"checkpoint {p.step}: no shard.encoded for {sorted(missing)[:3]}")
    done = [by_key[key] for key in sorted(p.plan.expected_keys())]
    if not all(recorded(s) for s in done):
        raise ValueError(f"checkpoint {p.step}: shard.encoded without a timeline")
    # The cast: every shard of ``done`` is ``recorded`` (checked above): its times are set.
    first_claim = min(cast(float, s.claimed_at) for s in done)
    last_in = max(s.finished_at for s in done)
    rows = [_row("save", p.save_started_at, p.saved_at),
            _row("wait: save → upload", p.saved_at, p.upload_started_at),
            _row("upload", p.upload_started_at, p.uploaded_at),
            _row("announce", p.uploaded_at, p.published_at),
            _row("wait: published → first shard claimed", p.published_at, first_claim)]
    for name, start, end in (("model load", "claimed_at", "loaded_at"),
                             ("tokenize", "loaded_at", "tokenized_at"),
                             ("encode", "tokenized_at", "encoded_at"),
                             ("shard upload", "upload_started_at", "finished_at")):
        first, last, busy = _span(done, start, end)
        rows.append(_row(name, first, last, busy_s=busy))
    t = times
    rows += [_row("wait: last shard in → index build", last_in, t.build_started_at),
             _row("index build", t.build_started_at, t.built_at),
             _row("search", t.built_at, t.searched_at),
             _row("mining", t.searched_at, t.mined_at),
             _row("evaluation", t.searched_at if t.mining_parallel_to_eval else t.mined_at,
                  t.evaluated_at, search_s=t.eval_search_s),
             _row("negatives.ready", max(t.mined_at, t.evaluated_at), t.announced_at)]
    encode_union = union_seconds((s.tokenized_at, s.encoded_at) for s in done)  # type: ignore[misc]
    return {
        "step": p.step,
        "rows": rows,
        "shards": [{"key": s.key, "instance": s.instance, "kind": str(s.kind),
                    "count": s.count, "claimed_at": s.claimed_at, "loaded_at": s.loaded_at,
                    "tokenized_at": s.tokenized_at, "encoded_at": s.encoded_at,
                    "upload_started_at": s.upload_started_at, "finished_at": s.finished_at,
                    "model_reloaded": s.model_reloaded, "tokens_cached": s.tokens_cached}
                   for s in done],
        "milestones": {"save_started": p.save_started_at, "published": p.published_at,
                       "first_shard_claimed": first_claim, "last_shard_in": last_in,
                       "plan_complete_read": t.complete_at, "negatives_ready": t.announced_at},
        "encode_union_s": encode_union,
        "search_s": (t.searched_at - t.built_at) + t.eval_search_s,
    }


def with_swap(timeline: dict, swap: Mapping[str, float] | None) -> dict:
    """``timeline`` completed with the trainer's swap of its tables (a ``trainer/summary.json``
    ``swaps`` entry: ``received_at``, ``held_at`` and, once a step trained on the table,
    ``used_at``) and the refresh's totals. Without a swap (the trainer had finished, or a
    newer table overtook it before the feed read it) the refresh ends at negatives.ready."""
    out = {**timeline, "rows": [r for r in timeline["rows"] if r["phase"] in INDEXER_PHASES]}
    ready = timeline["milestones"]["negatives_ready"]
    end = ready
    if swap is not None and swap.get("received_at") is not None:
        out["rows"] += [_row("wait: ready → trainer reads it", ready, swap["received_at"]),
                        _row("swap", swap["received_at"], swap["held_at"])]
        end = swap["held_at"]
        if swap.get("used_at") is not None:
            out["rows"].append(_row("wait: swapped in → first step on it", swap["held_at"],
                                    swap["used_at"]))
    out["swapped"] = end != ready
    start = timeline["milestones"]["save_started"]
    out["period_s"] = end - start  # save started → table swapped in (or ready)
    out["fixed_s"] = out["period_s"] - timeline["encode_union_s"] - timeline["search_s"]
    return out


def scalars(timeline: dict) -> dict[str, float]:
    """A timeline's rows as tracking scalars (``timeline/<row>_s``), logged at global step
    = the checkpoint's step."""
    out = {f"timeline/{_tag(r['phase'])}_s": r["seconds"] for r in timeline["rows"]}
    out["timeline/encode_union_s"] = timeline["encode_union_s"]
    out["timeline/search_s"] = timeline["search_s"]
    if "fixed_s" in timeline:
        out["timeline/fixed_s"] = timeline["fixed_s"]
        out["timeline/period_s"] = timeline["period_s"]
    return out


def swap_scalars(swap: Mapping[str, float], ready_at: float | None = None) -> dict[str, float]:
    """The trainer's rows as scalars (at global step = the table's checkpoint step)."""
    out = {"timeline/swap_s": swap["held_at"] - swap["received_at"]}
    if swap.get("used_at") is not None:
        out["timeline/swapped_in_to_first_step_s"] = swap["used_at"] - swap["held_at"]
    if ready_at is not None:
        out["timeline/ready_to_trainer_s"] = swap["received_at"] - ready_at
    return out


def _tag(phase: str) -> str:
    return (phase.replace("wait: ", "wait_").replace(" → ", "_to_").replace(".", "_")
            .replace(" ", "_"))


def run_timelines(store, summary: Mapping[str, Any] | None = None) -> list[dict]:
    """Every refresh's full timeline of a run, from its store: the indexer's part in each
    ``eval/<k>.json`` joined with the trainer's swaps (``summary``: ``trainer/summary.json``,
    read from the store when not given)."""
    from ance_train.infra.store import ObjectNotFound
    from ance_train.protocol import keys

    if summary is None:
        try:
            summary = store.get_json(keys.TRAINER_SUMMARY)
        except ObjectNotFound:
            summary = {}
    summary = summary or {}
    swaps = {int(step): times for step, times in summary.get("tables_swapped_in", {}).items()}
    swaps.update({s["negatives_step"]: s for s in summary.get("swaps", [])
                  if s.get("received_at") is not None})
    out = []
    for key in store.list(keys.EVAL_REPORTS):
        if keys.eval_report_step(key) is None:
            continue
        report = store.get_json(key)
        if "timeline" in report:
            out.append(with_swap(report["timeline"], swaps.get(report["step"])))
    return sorted(out, key=lambda t: t["step"])


def check_order(timeline: dict) -> list[str]:
    """What is out of order in ``timeline`` (empty: every row ends after it starts, the rows
    start in pipeline order, and each wait is the gap between its neighbours)."""
    problems = []
    rows = timeline["rows"]
    order = [PHASE_NAMES.index(r["phase"]) for r in rows]
    if order != sorted(order):
        problems.append(f"rows not in pipeline order: {[r['phase'] for r in rows]}")
    for row in rows:
        if row["end"] < row["start"]:
            problems.append(f"{row['phase']}: ends {row['start'] - row['end']:.4f}s before "
                            "it starts")
    for before, after in itertools.pairwise(rows):
        if after["start"] < before["start"]:
            problems.append(f"{after['phase']} starts before {before['phase']}")
    return problems
