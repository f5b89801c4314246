"""How hard are the negatives a run trained on, seen by the model at each of its checkpoints?

ANCE's argument (000_*.txt §3) is that negatives from the model's own ANN index are harder than
BM25 or random ones: they score closer to the positive, so they give larger gradients. This
script checks that claim on a kept run (``bench/quality.py --runs-dir``) without a model:
for every checkpoint whose embeddings the run stored and every negatives table the indexer
published (BM25 at ``bm25``, ANN at each refresh step), it scores the table's candidates
under that checkpoint's embeddings and reports, for one negative drawn per training query by
the table's own probabilities (what the trainer draws) and for one drawn uniformly from the
corpus (random negatives):

- the mean similarity gap ``sim(q, d⁺) − sim(q, d⁻)`` to the query's best positive;
- the share of draws scoring above the positive (the likeliest false negatives), and above
  0.95 × the positive (what ``negatives.max_positive_ratio: 0.95`` would drop);
- and, per checkpoint, where the positive ranks among all documents (training queries).

    python bench/negative_hardness.py runs/quality2/ance-s13 runs/quality2/bm25-random-s13 \\
        --out docs/benchmarks/tuning --name negative-hardness
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from ance_train.negatives.table import PAD, NegativesTable

from ance_train_dev.report import command_line, machine, utc_now, write_report
from ance_train_dev.stored_run import StoredCheckpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[2]
NEAR_POSITIVE = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+",
                        help="Kept run directories (<runs-dir>/<run_id>, holding config.yaml).")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="negative-hardness")
    return parser.parse_args(argv)


def positives_and_ranks(stored: StoredCheckpoint, query_ids: list[str], block: int = 256
                        ) -> tuple[dict[str, float], np.ndarray]:
    """Each query's similarity to its best positive and that positive's rank among all
    documents (1 = first), both read off one similarity row per query."""
    docs = stored.index.vectors(np.arange(stored.dataset.num_docs))
    vectors = stored.query_vectors(query_ids)
    best: dict[str, float] = {}
    ranks = np.empty(len(query_ids), dtype=np.int64)
    for start in range(0, len(query_ids), block):
        for row, sims in enumerate(vectors[start:start + block] @ docs.T, start=start):
            qid = query_ids[row]
            positives = stored.dataset.positives(qid)
            best[qid] = float(sims[positives].max())
            ranks[row] = int((sims > best[qid]).sum()) + 1
    return best, ranks


def draw_statistics(sims: np.ndarray, probabilities: np.ndarray, positive: np.ndarray) -> dict:
    """Expectations over one draw per query by ``probabilities`` (rows sum to 1 or to 0)."""
    mass = probabilities.sum(axis=1)
    rows = mass > 0
    p = probabilities[rows] / mass[rows, None]
    sims, positive = sims[rows], positive[rows, None]
    return {
        "queries": int(rows.sum()),
        "mean_gap": float((p * (positive - sims)).sum(axis=1).mean()),
        "p_above_positive": float((p * (sims > positive)).sum(axis=1).mean()),
        "p_above_near_positive": float((p * (sims > NEAR_POSITIVE * positive)).sum(axis=1)
                                       .mean()),
    }


def table_statistics(stored: StoredCheckpoint, table: NegativesTable,
                     positive: dict[str, float]) -> dict:
    query_ids = [str(q) for q in table.query_ids]
    valid = table.candidates != PAD
    sims = stored.index.scores(stored.query_vectors(query_ids),
                               np.where(valid, table.candidates, 0))
    probabilities = np.where(valid, table.probabilities, 0.0)
    return draw_statistics(sims, probabilities, np.array([positive[q] for q in query_ids]))


def random_statistics(stored: StoredCheckpoint, query_ids: list[str],
                      positive: dict[str, float], draws: int = 200, seed: int = 0) -> dict:
    """Random negatives: ``draws`` uniform corpus documents per query (positives excluded)."""
    rng = np.random.default_rng(seed)
    docs = rng.integers(stored.dataset.num_docs, size=(len(query_ids), draws))
    sims = stored.index.scores(stored.query_vectors(query_ids), docs)
    is_positive = np.array([[stored.dataset.train[q].get(int(d), 0) > 0 for d in row]
                            for q, row in zip(query_ids, docs, strict=True)])
    probabilities = np.where(is_positive, 0.0, 1.0)
    return draw_statistics(sims, probabilities, np.array([positive[q] for q in query_ids]))


def rank_summary(ranks: np.ndarray) -> dict:
    return {"median": float(np.median(ranks)), "mean": float(ranks.mean()),
            "share_first": float((ranks == 1).mean()), "share_top10": float((ranks <= 10).mean())}


def analyse_run(run_dir: Path) -> dict:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    run_id = config["run_id"]
    store = run_dir / "store" / run_id
    if not store.is_dir():
        raise SystemExit(f"{run_dir}: no store/{run_id}; is it a run kept by --runs-dir?")
    tables = {path.stem: NegativesTable.from_bytes(path.read_bytes())
              for path in sorted((store / "negatives").glob("*.npz"))
              if not path.stem.endswith("-dual")}
    steps = sorted(int(p.name) for p in (store / "embeddings").iterdir() if p.name.isdigit())
    checkpoints = []
    for step in steps:
        stored = load_checkpoint(store, step)
        train_ids = sorted(stored.dataset.train)
        positive, ranks = positives_and_ranks(stored, train_ids)
        entry = {"step": step, "positive_rank": rank_summary(ranks),
                 "tables": {name: table_statistics(stored, table, positive)
                            for name, table in tables.items()},
                 "random": random_statistics(stored, train_ids, positive)}
        checkpoints.append(entry)
        print(f"[hardness] {run_id} checkpoint {step}: {len(tables)} tables", flush=True)
    overrides = {k: v for k, v in config["negatives"].items()
                 if k in ("per_query", "max_positive_ratio", "sampling") and v is not None}
    return {"run_id": run_id, "label": f"{run_dir.parent.name}/{run_id}",
            "pool": config["negatives"]["pool"], "negatives": overrides,
            "checkpoints": checkpoints}


def markdown(report: dict) -> str:
    lines = ["# How hard are the negatives? (SciFact training queries)", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {report['machine']['cpu']}; {report['date']}", "",
             "One negative drawn per training query by the table's own probabilities (what the "
             "trainer draws), scored under the checkpoint's embeddings. *gap* = mean "
             "sim(q, d⁺) − sim(q, d⁻) to the best positive (smaller = harder); *above d⁺* = "
             "share of draws scoring above the positive; *> 0.95·d⁺* = share that "
             "`negatives.max_positive_ratio: 0.95` would drop. Table `bm25` is the BM25 "
             "top 100; a number is the ANN table mined at that refresh; `random` is uniform "
             "over the corpus.", "",
             "Runs are named <runs-dir>/<run id>; the negatives settings of each are in the "
             "JSON.", "",
             "| run | checkpoint | positive rank (median / mean / share first) | negatives | "
             "gap | above d⁺ | > 0.95·d⁺ |",
             "|---|---:|---|---|---:|---:|---:|"]
    for run in report["runs"]:
        for entry in run["checkpoints"]:
            rank = entry["positive_rank"]
            rank_text = (f"{rank['median']:.0f} / {rank['mean']:.1f} / "
                         f"{rank['share_first']:.2f}")
            rows = [*entry["tables"].items(), ("random", entry["random"])]
            for name, stats in rows:
                lines.append(f"| {run['label']} | {entry['step']} | {rank_text} | {name} | "
                             f"{stats['mean_gap']:.3f} | {stats['p_above_positive']:.3f} | "
                             f"{stats['p_above_near_positive']:.3f} |")
                rank_text = ""
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = {"command": command_line(), "date": utc_now(), "machine": machine(),
              "near_positive": NEAR_POSITIVE,
              "runs": [analyse_run(run_dir) for run_dir in args.runs]}
    write_report(args.out, args.name, report, markdown(report))
