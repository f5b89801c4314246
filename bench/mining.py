"""Mining at MS MARCO size: the refresh path's per-row Python loops before and after
vectorising (issue 15, item 6), and the trainer's table load, in memory vs memory-mapped.

Synthetic inputs shaped like MS MARCO passage training (``--queries`` training queries, an
8.8M-document corpus, 1.06 positives per query, the positive found in the ranking for half
the queries, ANCE top-200, ANCE-Tele rows of 400): the search results of the refresh, the
previous refresh's table (half of each row carried over, as consecutive refreshes share
candidates), lookahead neighbours. Each stage of the refresh path runs in the code of
``src`` ("after") and in the per-row code it replaced ("before", the references kept in
``dev/ance_train_dev/mining_reference.py``, never shipped) on the same inputs; the outputs are
checked equal, bit for bit. FAISS search and the dense scores are left out: they were never
per-row Python and did not change.

Stages and the pools whose refresh runs them (per 100k training queries):

- ``remove_positives``: the search results minus the positives (every ANN pool; ANCE-Tele
  twice: the query's and the lookahead neighbours), ``anchors``: d̃⁺ drawn per query;
- ``first_seen``: the step each candidate entered its row (every ANN table; 400 wide for
  ANCE-Tele), ``remine``: ``negatives.remine_fraction`` 0.5 (``keep_previous_rows`` +
  ``merge_remined``);
- ``momentum``: the previous table aligned to the queries, ``mix_rows``: ANCE-Tele's
  mixture of 200 + 400 + 200 candidates capped at 400;
- ``dance_rows``: DANCE's owners of each positive document and its table's rows;
- ``diagnostics``: the overlap of the table in use with the top 100, the first-seen
  composition and the sample's MRR.

The table load runs in a child process per mode, as the trainer's negatives feed does it:
``memory`` (``from_bytes(store.get_bytes(key))``, the only way before) and ``mmap``
(``store.get_file`` to the work directory, then :meth:`NegativesTable.open`), then draws
``--batches`` batches with ``sample_many``; it reports the load time, the peak RSS
(``VmHWM``) over the child's baseline and the anonymous / file-backed RSS at the end.

    python bench/mining.py --queries 100000 500000 --reference-max 100000 \\
        --out docs/benchmarks

Writes ``mining.json`` and ``mining.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ance_train.indexer.diagnostics import reciprocal_ranks
from ance_train.infra.store.local import LocalStore
from ance_train.negatives.mining import align_rows, draw_anchors, first_seen
from ance_train.negatives.rows import Positives
from ance_train.negatives.strategies.ance import keep_previous_rows, merge_remined
from ance_train.negatives.strategies.dance import _decimal_strings
from ance_train.negatives.strategies.tele import mix_rows
from ance_train.negatives.table import (
    PAD,
    SOURCE_CODE,
    NegativesTable,
    overlap_at,
    remove_positives,
    source_codes,
    uniform_probabilities,
)
from ance_train.protocol.tables import TableId
from ance_train.trainer.negatives_feed import NegativesFeed

from ance_train_dev.mining_reference import (
    reference_align_rows,
    reference_anchors,
    reference_composition,
    reference_dual_rows,
    reference_first_seen,
    reference_keep_previous_rows,
    reference_merge_remined,
    reference_mix_rows,
    reference_overlap_at,
    reference_owners,
    reference_reciprocal_ranks,
    reference_remove_positives,
)
from ance_train_dev.report import command_line, cpu_flags, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]

MS_MARCO_DOCS = 8_841_823
STEP, PREVIOUS_STEP = 6, 3
# Which stages one refresh of each pool runs (a stage listed twice runs twice).
POOLS = {
    "ANCE (pool ann, remine_fraction 0.5)":
        ["remove_positives", "anchors", "first_seen", "remine", "diagnostics"],
    "ANCE-Tele (pool tele, 400 candidates)":
        ["remove_positives", "anchors", "remove_positives", "momentum", "mix_rows",
         "first_seen_400", "diagnostics"],
    "ANCE + DANCE (dual_weight > 0)":
        ["remove_positives", "anchors", "first_seen", "dance_rows", "diagnostics"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, nargs="+", default=[100_000])
    parser.add_argument("--reference-max", type=int, default=100_000,
                        help="run the per-row reference only up to this many queries")
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--tele-candidates", type=int, default=400)
    parser.add_argument("--tele-max", type=int, default=100_000,
                        help="run ANCE-Tele's stages only up to this many queries (memory)")
    parser.add_argument("--docs", type=int, default=MS_MARCO_DOCS)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the vectorised code")
    parser.add_argument("--batches", type=int, default=200, help="sample_many batches drawn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--load-worker", nargs=3, metavar=("STORE", "CACHE", "MODE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="re-render a measured mining.json")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- inputs


def make_inputs(queries: int, top_k: int, tele_k: int | None, docs: int, seed: int) -> dict:
    """The refresh's inputs, shaped as the indexer hands them to mining (see the docstring)."""
    rng = np.random.default_rng(seed)
    train_ids = np.char.zfill(np.arange(queries).astype(str), 7)  # sorted, as the indexer's
    counts = 1 + (rng.random(queries) < 0.06)
    positive_rows = [set(rng.integers(0, docs, size=c).tolist()) for c in counts]
    depth = max(100, top_k) + int(counts.max())
    ranked = rng.integers(0, docs, size=(queries, depth)).astype(np.int64)
    found = np.flatnonzero(rng.random(queries) < 0.5)  # the positive is in the ranking
    ranked[found, rng.integers(0, 20, size=len(found))] = [min(positive_rows[i]) for i in found]
    sims = -np.sort(-rng.random((queries, depth), dtype=np.float32), axis=1)
    positives = Positives.from_rows(positive_rows)
    candidates, scores = remove_positives(ranked, sims, positives, top_k)

    def table(step: int, width: int, shift: int) -> NegativesTable:
        """A previous table: ``candidates`` moved ``shift`` columns left, fresh documents
        after them (consecutive refreshes share part of each row)."""
        fresh = rng.integers(0, docs, size=(queries, width - top_k + shift))
        cand = np.concatenate([candidates[:, shift:], fresh], axis=1)[:, :width]
        return NegativesTable(
            step=step, query_ids=train_ids, candidates=cand,
            scores=rng.random(cand.shape, dtype=np.float32),
            positive_scores=rng.random(queries, dtype=np.float32),
            probabilities=uniform_probabilities(cand), sources=source_codes(cand, "ann"),
            first_seen=rng.integers(0, step + 1, size=cand.shape))

    previous = table(PREVIOUS_STEP, top_k, top_k // 2)
    previous_tele = None if tele_k is None else table(PREVIOUS_STEP, tele_k, top_k // 2)
    new = NegativesTable(step=STEP, query_ids=train_ids, candidates=candidates, scores=scores,
                         positive_scores=np.zeros(queries, np.float32),
                         probabilities=uniform_probabilities(candidates),
                         sources=source_codes(candidates, "ann"))
    look = None if tele_k is None else np.concatenate(
        [candidates[:, :20], rng.integers(0, docs, size=(queries, top_k - 20))], axis=1)
    sample = np.sort(rng.choice(queries, size=min(500, queries), replace=False))
    return {"train_ids": train_ids, "id_list": train_ids.tolist(), "positives": positives,
            "positive_rows": positive_rows, "ranked": ranked, "sims": sims, "top_k": top_k,
            "tele_k": tele_k, "candidates": candidates, "new": new, "previous": previous,
            "previous_tele": previous_tele, "lookahead": look, "sample": sample}


# --------------------------------------------------------------------------- stages


def _tele_parts(x: dict, momentum: tuple[np.ndarray, np.ndarray]) -> list:
    new = x["new"]
    return [(new.candidates, new.probabilities, SOURCE_CODE["ann"], 1.0),
            (momentum[0], momentum[1], SOURCE_CODE["momentum"], 0.5),
            (x["lookahead"], uniform_probabilities(x["lookahead"]), SOURCE_CODE["lookahead"],
             0.5)]


def _copy(table: NegativesTable) -> NegativesTable:
    return NegativesTable(**{name: getattr(table, name).copy() if name != "step"
                             else table.step for name in
                             ("step", "query_ids", "candidates", "scores", "positive_scores",
                              "probabilities", "sources", "first_seen")})


def stages(x: dict) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Stage → (after, before): each a call on the prepared inputs returning its outputs."""
    ids, sets, top_k = x["id_list"], x["positive_rows"], x["top_k"]
    new, previous, previous_tele = x["new"], x["previous"], x["previous_tele"]
    tele_candidates = {}

    def mix(mixer: Callable) -> Callable[[], object]:
        parts: list[list] = []

        def prepare() -> None:  # the momentum rows (stage ``momentum``) aligned beforehand
            parts.append(_tele_parts(x, align_rows(previous_tele, ids)))

        def run() -> object:
            return mixer(parts.pop(), x["tele_k"])
        run.prepare = prepare  # type: ignore[attr-defined]
        return run

    def first_seen_400(fn: Callable) -> Callable[[], object]:
        def prepare() -> None:  # the mixed rows, made once
            if "ids" not in tele_candidates:
                tele_candidates["ids"] = mix_rows(
                    _tele_parts(x, align_rows(previous_tele, ids)), x["tele_k"])[0]

        def run() -> object:
            return fn(tele_candidates["ids"], STEP, previous_tele, ids)
        run.prepare = prepare  # type: ignore[attr-defined]
        return run

    def remine(keep: Callable, merge: Callable) -> Callable[[], object]:
        copies: list[NegativesTable] = []

        def prepare() -> None:  # the copy the merge writes into is made outside the timing
            copies.append(_copy(new))

        def run() -> object:
            table = copies.pop()
            remined = keep(table, previous, 0.5, np.random.default_rng(1))
            merge(table, previous, remined)
            return [table.candidates, table.scores, table.probabilities, table.sources,
                    table.first_seen]
        run.prepare = prepare  # type: ignore[attr-defined]
        return run

    def dance_after() -> object:
        docs, excluded = x["positives"].owners()
        return _decimal_strings(docs), [set(excluded.row(i).tolist()) for i in (0, len(docs) - 1)]

    def dance_before() -> object:
        owners = reference_owners(sets)
        docs = sorted(owners)
        rows, excluded = reference_dual_rows(docs, owners)
        return rows, [excluded[0], excluded[-1]]

    def diagnostics(align: Callable, overlap: Callable, composition: Callable,
                    mrr: Callable) -> Callable[[], object]:
        def run() -> object:
            used, _ = align(previous, ids)
            sample = x["sample"]
            return (overlap(used, x["ranked"][:, :100]), composition(new),
                    mrr(x["ranked"][sample], [sets[i] for i in sample]))
        return run

    def composition_after(table: NegativesTable) -> dict[str, int]:
        steps, counts = np.unique(table.first_seen[table.candidates != PAD], return_counts=True)
        return {str(k): int(v) for k, v in zip(steps.tolist(), counts.tolist(), strict=True)}

    tele = {} if previous_tele is None else {
        "momentum": (lambda: align_rows(previous_tele, ids),
                     lambda: reference_align_rows(previous_tele, ids)),
        "mix_rows": (mix(mix_rows), mix(reference_mix_rows)),
        "first_seen_400": (first_seen_400(first_seen), first_seen_400(reference_first_seen)),
    }
    return tele | {
        "remove_positives": (
            lambda: remove_positives(x["ranked"], x["sims"], x["positives"], top_k),
            lambda: reference_remove_positives(x["ranked"], x["sims"], sets, top_k)),
        "anchors": (
            lambda: draw_anchors(x["positives"], np.random.default_rng([0, STEP])),
            lambda: reference_anchors([sorted(p) for p in sets],
                                      np.random.default_rng([0, STEP]))),
        "first_seen": (
            lambda: first_seen(new.candidates, STEP, previous, ids),
            lambda: reference_first_seen(new.candidates, STEP, previous, ids)),
        "remine": (remine(keep_previous_rows, merge_remined),
                   remine(reference_keep_previous_rows, reference_merge_remined)),
        "dance_rows": (dance_after, dance_before),
        "diagnostics": (
            diagnostics(align_rows, overlap_at, composition_after, reciprocal_ranks),
            diagnostics(reference_align_rows, reference_overlap_at, reference_composition,
                        reference_reciprocal_ranks)),
    }


def _time(fn: Callable[[], object]) -> tuple[float, float, object]:
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def _equal(a: object, b: object) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(p, q) for p, q in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    return a == b


def measure(x: dict, repeats: int, reference: bool) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for name, (after, before) in stages(x).items():
        runs = [_time(after) for _ in range(repeats)]
        row = {"after_wall_s": statistics.median(r[0] for r in runs),
               "after_cpu_s": statistics.median(r[1] for r in runs)}
        if reference:
            wall, cpu, expected = _time(before)
            row.update(before_wall_s=wall, before_cpu_s=cpu,
                       identical=_equal(runs[0][2], expected))
            if not row["identical"]:
                raise AssertionError(f"{name}: the vectorised output differs from the reference")
        results[name] = row
        print(f"{len(x['id_list'])} {name}: after {row['after_wall_s']:.2f}s"
              + (f", before {row['before_wall_s']:.2f}s" if reference else ""),
              file=sys.stderr)
    return results


# --------------------------------------------------------------------------- table load


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def load_worker(store_dir: str, cache: str, mode: str, batches: int, batch_size: int) -> None:
    """Child: load the stored table as the trainer's feed does, draw batches, report."""
    store = LocalStore("bench", Path(store_dir))
    feed = NegativesFeed(None, store, "bench", threading.Event(),  # type: ignore[arg-type]
                         cache_dir=None if mode == "memory" else Path(cache))
    baseline = _status("VmRSS")
    started = time.perf_counter()
    table = feed._load(TableId.ann(STEP))
    load_s = time.perf_counter() - started
    after_load = {"rss": _status("VmRSS"), "peak": _status("VmHWM")}
    rng = np.random.default_rng(0)
    ids = np.asarray(table.query_ids)
    started = time.perf_counter()
    for _ in range(batches):
        table.sample_many(ids[rng.integers(0, len(ids), size=batch_size)].tolist(), 1, rng)
    sample_s = time.perf_counter() - started
    print(json.dumps({
        "mode": mode, "load_s": load_s, "sample_ms_per_batch": 1000 * sample_s / batches,
        "baseline_rss": baseline, "rss_after_load": after_load["rss"] - baseline,
        "peak_rss_load": after_load["peak"] - baseline,
        "peak_rss": _status("VmHWM") - baseline,
        "rss_anon_end": _status("RssAnon"), "rss_file_end": _status("RssFile")}))


def measure_load(x: dict, batches: int, batch_size: int) -> dict:
    """The table of ``x`` stored, then loaded by child processes; ``x`` is emptied first
    (the children's peaks stay alone in memory)."""
    with tempfile.TemporaryDirectory(prefix="bench-mining-") as tmp:
        store = LocalStore("bench", Path(tmp) / "store")
        started = time.perf_counter()
        data = x["new"].to_bytes()
        write_s = time.perf_counter() - started
        x.clear()
        gc.collect()
        store.put_bytes(TableId.ann(STEP).key, data)
        size = len(data)
        del data
        rows = []
        for mode in ("memory", "mmap"):
            done = subprocess.run(
                [sys.executable, __file__, "--load-worker", str(Path(tmp) / "store"),
                 str(Path(tmp) / f"work-{mode}"), mode, "--batches", str(batches),
                 "--batch-size", str(batch_size)],
                check=True, capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"table_bytes": size, "to_bytes_s": write_s, "modes": rows}


# --------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_worker:
        load_worker(*args.load_worker, args.batches, args.batch_size)
        return 0
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        write_report(args.out, "mining", report, render_markdown(report))
        return 0
    load_start = os.getloadavg()
    sizes = []
    for queries in args.queries:
        started = time.perf_counter()
        x = make_inputs(queries, args.top_k,
                        args.tele_candidates if queries <= args.tele_max else None,
                        args.docs, args.seed)
        print(f"{queries}: inputs in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        load1 = os.getloadavg()[0]
        results = measure(x, args.repeats, queries <= args.reference_max)
        load = measure_load(x, args.batches, args.batch_size)
        sizes.append({"queries": queries, "load1_before": load1, "stages": results,
                      "table_load": load})
    report = {"command": command_line(), "date": utc_now(),
              "machine": {**machine(), "cpu_flags": cpu_flags(),
                          "numpy": np.__version__, "load_average_start": load_start,
                          "load_average_end": os.getloadavg()},
              "params": {"queries": args.queries, "top_k": args.top_k,
                         "tele_candidates": args.tele_candidates, "docs": args.docs,
                         "positives_per_query": 1.06, "repeats": args.repeats,
                         "reference_max": args.reference_max, "tele_max": args.tele_max,
                         "batches": args.batches,
                         "batch_size": args.batch_size, "seed": args.seed},
              "pools": POOLS, "sizes": sizes}
    write_report(args.out, "mining", report, render_markdown(report))
    return 0


def _per_100k(seconds: float, queries: int) -> float:
    return seconds * 100_000 / queries


def render_markdown(report: dict) -> str:
    p, m = report["params"], report["machine"]
    lines = [
        "# Mining at MS MARCO size: the refresh path before and after vectorising", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores (flags: {', '.join(m['cpu_flags']) or '—'}), "
        f"numpy {m['numpy']}, {m['platform']}; {report['date']}. Load average (1 min) at "
        f"start {m['load_average_start'][0]:.2f}, at end {m['load_average_end'][0]:.2f} "
        "(a shared machine: the comparison is on CPU seconds of the process, which other "
        "processes' load inflates less than wall seconds; both are single-threaded code).",
        "",
        f"Inputs (synthetic, `bench/mining.py`): {p['docs']:,} documents, "
        f"{p['positives_per_query']} positives per query, top-{p['top_k']} ANN candidates, "
        f"ANCE-Tele rows of {p['tele_candidates']}, the previous table sharing half of each "
        "row. *Before*: the per-row code replaced (`dev/ance_train_dev/mining_reference.py`), run "
        f"once; *after*: `src`, median of {p['repeats']} runs. Every *after* output was "
        "checked equal to *before*'s, bit for bit, where both ran.", "",
        "## Mining time per 100k training queries", "",
    ]
    for size in report["sizes"]:
        q, stages_ = size["queries"], size["stages"]
        has_before = all("before_wall_s" in s for s in stages_.values())
        lines += [f"### {q:,} training queries (load average before: {size['load1_before']:.2f})",
                  ""]
        if has_before:
            lines += ["| refresh | before: CPU s / 100k | after: CPU s / 100k | speed-up "
                      "(CPU) | before: wall s | after: wall s |",
                      "|---|---:|---:|---:|---:|---:|"]
        else:
            lines += ["| refresh | after: CPU s / 100k | after: wall s / 100k |",
                      "|---|---:|---:|"]
        for pool, names in report["pools"].items():
            if any(n not in stages_ for n in names):
                continue
            after = _per_100k(sum(stages_[n]["after_cpu_s"] for n in names), q)
            after_wall = _per_100k(sum(stages_[n]["after_wall_s"] for n in names), q)
            if has_before:
                before = _per_100k(sum(stages_[n]["before_cpu_s"] for n in names), q)
                before_wall = _per_100k(sum(stages_[n]["before_wall_s"] for n in names), q)
                lines.append(f"| {pool} | {before:.1f} | {after:.2f} | {before / after:.0f}× | "
                             f"{before_wall:.1f} | {after_wall:.2f} |")
            else:
                lines.append(f"| {pool} | {after:.2f} | {after_wall:.2f} |")
        lines += ["", "Per stage (seconds per 100k queries):", ""]
        if has_before:
            lines += ["| stage | before CPU | after CPU | speed-up (CPU) | before wall | "
                      "after wall | identical |", "|---|---:|---:|---:|---:|---:|---|"]
        else:
            lines += ["| stage | after CPU | after wall |", "|---|---:|---:|"]
        for name, s in stages_.items():
            aw, ac = _per_100k(s["after_wall_s"], q), _per_100k(s["after_cpu_s"], q)
            if has_before:
                bw, bc = _per_100k(s["before_wall_s"], q), _per_100k(s["before_cpu_s"], q)
                lines.append(f"| `{name}` | {bc:.2f} | {ac:.3f} | {bc / ac:.1f}× | {bw:.2f} | "
                             f"{aw:.3f} | {'yes' if s['identical'] else 'NO'} |")
            else:
                lines.append(f"| `{name}` | {ac:.3f} | {aw:.3f} |")
        lines.append("")
    lines += ["## Trainer: loading a table", "",
              "The ANN table of the refresh (top-200), stored in a local object store; the "
              "trainer's negatives feed loads it in a child process, then draws "
              f"{p['batches']} batches of {p['batch_size']} queries (`sample_many`). RSS in "
              "MB above the child's baseline (after imports); *anon/file at end*: the "
              "child's anonymous / file-backed resident memory after the draws (file-backed "
              "pages are the page cache's, dropped under memory pressure).", "",
              "| queries | table MB | mode | load s | peak RSS (load) | RSS after load | "
              "anon / file at end | ms per batch |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for size in report["sizes"]:
        load = size["table_load"]
        for mode in load["modes"]:
            lines.append(
                f"| {size['queries']:,} | {load['table_bytes'] / 1e6:,.0f} | {mode['mode']} | "
                f"{mode['load_s']:.2f} | {mode['peak_rss_load'] / 1e6:,.0f} | "
                f"{mode['rss_after_load'] / 1e6:,.0f} | {mode['rss_anon_end'] / 1e6:,.0f} / "
                f"{mode['rss_file_end'] / 1e6:,.0f} | {mode['sample_ms_per_batch']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
