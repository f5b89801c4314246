"""Paired significance of the quality benchmark's differences, over test queries.

A quality report (``bench/quality.py``) gives one mean per method; whether two means differ
by more than the choice of queries explains needs per-query scores. For every run of the
report this script rebuilds the test ranking of the selected checkpoint from the embeddings
the run stored (``--runs-dir``), by exact inner-product search with the indexer's own
``AnnIndex``, and stops if that does not reproduce the reported test nDCG@10. A method's
per-query nDCG@10 is the mean over its seeds. References: BM25 (bm25s, as in the report)
and zero-shot (checkpoint 0).

Each ANCE-family method is compared with each DPR-style baseline (the sentence-transformers
peer ``st-static`` among them) and each reference by a two-sided paired randomization test
(sign flips of the per-query differences, Smucker et al. 2007), with a 95 % percentile-bootstrap
interval of the mean difference and Benjamini-Hochberg adjusted p-values over all comparisons
in the table. ``--reference NAME`` instead compares every other system of the report (every
method, zero-shot, BM25) with the one system NAME, e.g. the peer:

    python bench/significance.py docs/benchmarks/quality-cpu.json \\
        --runs-dir runs/quality2 runs/quality3
    python bench/significance.py docs/benchmarks/quality-cpu.json --runs-dir runs/quality \\
        --reference st-static --name quality-cpu-significance-vs-peer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy import stats

from ance_train.evaluation import evaluate_per_query

from ance_train_dev.peer_sentence_transformers import index_similarity as peer_index_similarity
from ance_train_dev.quality import ALL_METHODS, PEER, bm25_runs, display_name
from ance_train_dev.report import command_line, machine, utc_now, write_report
from ance_train_dev.stored_run import find_run_dir, load_checkpoint

REPO = Path(__file__).resolve().parents[2]
ANCE_FAMILY = ["ance", "simans", "ance-tele", "dance"]
BASELINES = [m for m in ALL_METHODS if m not in ANCE_FAMILY]
ZERO_SHOT, BM25 = "zero-shot", "BM25"
RESAMPLES = 10_000
TOLERANCE = 1e-4  # rebuilt vs reported mean nDCG@10 (same index build; another CPU's BLAS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="A quality report JSON (bench/quality.py).")
    parser.add_argument("--runs-dir", type=Path, nargs="+", required=True,
                        help="Where the report's runs were kept (quality.py --runs-dir).")
    parser.add_argument("--data", type=Path,
                        help="The dataset for BM25 (default: the runs' own data.path).")
    parser.add_argument("--reference", metavar="NAME",
                        help="Compare every other system (methods, zero-shot, BM25) with NAME "
                             f"(a method of the report, {ZERO_SHOT!r} or {BM25!r}) instead of "
                             "the ANCE family with the baselines; e.g. --reference st-static.")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", help="Output stem (default <report stem>-significance).")
    parser.add_argument("--seed", type=int, default=0, help="Resampling seed.")
    return parser.parse_args(argv)


def index_similarity(run: dict) -> str:
    """The similarity of the index the run's own evaluation searched: the indexer's takes
    the model's vectors as they are (``dot``); the peer's evaluator has its own."""
    if run.get("base_method", run["method"]) == PEER:
        return peer_index_similarity(run["config"]["model"])
    return "dot"


def rebuilt_test_ranking(store_dir: Path, step: int, similarity: str, depth: int = 100
                         ) -> tuple[dict, dict]:
    """The test run (query → {doc: score}) of checkpoint ``step`` and the test qrels."""
    stored = load_checkpoint(store_dir, step, similarity)
    qids = sorted(stored.dataset.test)
    ranked, scores = stored.index.search(stored.query_vectors(qids), depth, 1024)
    run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
           for q, r, sc in zip(qids, ranked, scores, strict=True)}
    qrels = {q: {str(d): rel for d, rel in stored.dataset.test[q].items()} for q in qids}
    return run, qrels


def per_query_scores(report: dict, roots: list[Path]) -> tuple[dict[str, dict], dict]:
    """System → {test query → nDCG@10}: each method (mean over seeds) and zero-shot."""
    by_method: dict[str, list[dict[str, float]]] = {}
    zero_shot: dict[str, float] | None = None
    qrels: dict | None = None
    for run in report["runs"]:
        # The run's own output directory first: labelled variants share run ids with the
        # method they vary (both "ance-s13"), in different --runs-dir.
        store_dir = find_run_dir(run["config"]["run_id"],
                                 [Path(run["config"]["output_dir"]), *roots])
        similarity = index_similarity(run)
        ranking, run_qrels = rebuilt_test_ranking(store_dir, run["selected_step"], similarity)
        if qrels is not None and run_qrels != qrels:
            raise SystemExit(f"{store_dir}: its test qrels differ from the other runs'")
        qrels = run_qrels
        scores = evaluate_per_query(ranking, qrels)
        rebuilt, reported = float(np.mean(list(scores.values()))), run["test"]["ndcg@10"]
        if abs(rebuilt - reported) > TOLERANCE:
            raise SystemExit(f"{store_dir}: checkpoint {run['selected_step']} rebuilt gives "
                             f"test nDCG@10 {rebuilt:.6f}, the report says {reported:.6f}")
        by_method.setdefault(run["method"], []).append(scores)
        if zero_shot is None:
            zero_shot = evaluate_per_query(rebuilt_test_ranking(store_dir, 0, similarity)[0], qrels)
    assert qrels is not None and zero_shot is not None
    systems = {method: {q: float(np.mean([s[q] for s in seeds])) for q in qrels}
               for method, seeds in by_method.items()}
    systems[ZERO_SHOT] = zero_shot
    return systems, qrels


def compare(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> dict:
    """Mean paired difference a − b, its 95 % bootstrap interval, randomization p-value."""
    diff = a - b
    test = stats.permutation_test((a, b), lambda x, y, axis: np.mean(x - y, axis=axis),
                                  permutation_type="samples", n_resamples=RESAMPLES,
                                  alternative="two-sided", vectorized=True, random_state=rng)
    if np.all(diff == diff[0]):  # e.g. two methods that selected the very same model
        low = high = float(diff[0])
    else:
        interval = stats.bootstrap((diff,), np.mean, n_resamples=RESAMPLES,
                                   confidence_level=0.95, method="percentile",
                                   random_state=rng).confidence_interval
        low, high = float(interval.low), float(interval.high)
    return {"delta": float(diff.mean()), "ci95": [low, high],
            "p": float(test.pvalue), "wins": int((diff > 0).sum()),
            "losses": int((diff < 0).sum()), "ties": int((diff == 0).sum())}


def significance(report: dict, roots: list[Path], data: Path, seed: int,
                 reference: str | None = None) -> dict:
    systems, qrels = per_query_scores(report, roots)
    bm25_run, bm25_qrels = bm25_runs(data)
    if bm25_qrels["test"] != qrels:
        raise SystemExit(f"{data}: BM25's test qrels differ from the runs'")
    systems[BM25] = evaluate_per_query(bm25_run["test"], qrels)
    queries = sorted(qrels)
    vector = {name: np.array([scores[q] for q in queries]) for name, scores in systems.items()}
    rng = np.random.default_rng(seed)
    base_of = {run["method"]: run.get("base_method", run["method"]) for run in report["runs"]}
    family = sorted((m for m in base_of if base_of[m] in ANCE_FAMILY),
                    key=lambda m: ANCE_FAMILY.index(base_of[m]))
    baselines = [m for m in base_of if base_of[m] in BASELINES]
    if reference is not None:
        if reference not in vector:
            raise SystemExit(f"--reference {reference!r}: not a system of this report "
                             f"(choose from {sorted(vector)})")
        pairs = [(name, reference) for name in [*base_of, ZERO_SHOT, BM25] if name != reference]
    else:
        pairs = [(method, other) for method in family
                 for other in [*baselines, ZERO_SHOT, BM25] if other in vector]
    rows = [{"method": method, "versus": other, **compare(vector[method], vector[other], rng)}
            for method, other in pairs]
    if rows:
        adjusted = stats.false_discovery_control([row["p"] for row in rows])
        for row, p in zip(rows, adjusted, strict=True):
            row["p_bh"] = float(p)
    seeds = {m: sorted(r["seed"] for r in report["runs"] if r["method"] == m) for m in systems
             if m not in (ZERO_SHOT, BM25)}
    return {"command": command_line(), "date": utc_now(), "machine": machine(),
            "report": report.get("name"), "dataset": report.get("dataset", "scifact"),
            "reference": reference, "test_queries": len(queries), "seeds": seeds,
            "mean_ndcg@10": {name: float(v.mean()) for name, v in vector.items()},
            "resamples": RESAMPLES, "comparisons": rows}


def _p(value: float) -> str:
    return "< 0.001" if value < 0.001 else f"{value:.3f}"


def render_markdown(result: dict) -> str:
    lines = [f"# Paired significance on {display_name(result.get('dataset', 'scifact'))} test "
             f"({result['report']})", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']['cpu']}; {result['date']}. "
             f"{result['test_queries']} test queries; per-query nDCG@10 of each method's "
             "dev-selected checkpoint, averaged over its seeds "
             f"({', '.join(f'{m}: {len(s)}' for m, s in result['seeds'].items())}). "
             f"Two-sided paired randomization test ({result['resamples']} resamples), 95 % "
             "percentile-bootstrap interval of the mean difference, Benjamini-Hochberg "
             "adjusted p over the whole table.", "",
             "| method | versus | Δ nDCG@10 | 95 % interval | queries better / worse / tied "
             "| p | p (BH) |", "|---|---|---:|---|---|---:|---:|"]
    for row in result["comparisons"]:
        low, high = row["ci95"]
        lines.append(f"| {row['method']} | {row['versus']} | {row['delta']:+.4f} | "
                     f"[{low:+.4f}, {high:+.4f}] | {row['wins']} / {row['losses']} / "
                     f"{row['ties']} | {_p(row['p'])} | {_p(row['p_bh'])} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = json.loads(args.report.read_text())
    data = args.data or Path(report["runs"][0]["config"]["data"]["path"])
    result = significance(report, [r.resolve() for r in args.runs_dir], data, args.seed,
                          args.reference)
    name = args.name or f"{args.report.stem}-significance"
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, name, result, render_markdown(result))
    return 0
