"""Weight interpolation towards the starting model, scanned offline over finished runs (issue 33).

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", arXiv 2109.01903) serves
``θ0 + α (θ − θ0)``: the zero-shot weights ``θ0`` moved a fraction ``α`` of the way to the
fine-tuned ``θ``. On a small training set it is the regularisation towards the starting model
that issue 33 lists, applied after training, so one run answers it for every α.

For each run directory of ``bench/quality.py --keep-checkpoints`` and each of its checkpoints,
every α is encoded and evaluated the way the indexer evaluates a refresh (the run's config: its
precision, lengths, prompts; float16 embeddings as the inferencers store them; a flat index;
``ance_train.evaluation.evaluate``), so α = 1 reproduces the run's own evaluation (up to bf16
batch composition: the run's query shards batch other queries together, which can move a
15-query dev value in its third decimal) and α = 0 the zero-shot one. Without
``--heldout-data``, α = 1 is read from the run's own eval reports instead of encoded. The
report has dev and test nDCG@10 per (run, step, α), and the mean over runs.

``--heldout-data`` adds a third split for deciding defaults on a training-set cut
(``quality.py --train-queries``): the uncut dataset's training queries that the run neither
trained on nor used as dev. They are dev-side data (never test), and far more of them than the
cut's own dev slice (about 15 queries for SciFact cut to 150), so a recipe's default can be
decided on them where the dev slice is only noise.

    python bench/interpolation.py --runs /work/runs/scifact150/ance-s13 ... \\
        --alphas 0 0.25 0.5 0.75 1 --name interpolation-scifact150
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from ance_train.config import RunConfig, load_config
from ance_train.data.corpus import open_corpus
from ance_train.data.dataset import DatasetIndex
from ance_train.data.validation import validate_dataset
from ance_train.modeling.encoding import encode_texts, prepare_model, resolve_precision
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol import keys
from ance_train.trainer.interpolation import blend

from ance_train_dev.quality import SELECTION_RULES, select_checkpoint
from ance_train_dev.report import command_line, machine, machine_line, utc_now, write_report
from ance_train_dev.stored_run import evaluate_flat

REPO = Path(__file__).resolve().parents[2]
SPLITS = ("dev", "test")
HELDOUT = "heldout"
MEASURE = "ndcg@10"


def interpolate(base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor],
                alpha: float) -> dict[str, torch.Tensor]:
    """The trainer's blend (``trainer/interpolation.blend``) of every floating tensor; the
    others (integer buffers such as position ids) are the tuned model's."""
    if base.keys() != tuned.keys():
        raise ValueError(f"the models' tensors differ: {sorted(base.keys() ^ tuned.keys())[:5]}")
    floats = {name: value for name, value in tuned.items() if value.is_floating_point()}
    return {**tuned, **blend(base, floats, alpha)}


class RunEvaluator:
    """Encodes and evaluates weights with one run's config, dataset and corpus."""

    def __init__(self, run_dir: Path, heldout_data: Path | None = None) -> None:
        self.run_dir = run_dir
        self.config: RunConfig = load_config(run_dir / "config.yaml")
        self.store = run_dir / "store" / self.config.run_id
        self.dataset = DatasetIndex.from_json((self.store / keys.DATASET_INDEX).read_text())
        cache = run_dir / "cache"  # the run's own (doc_offsets.npy, made by its validation)
        if not (cache / "doc_offsets.npy").is_file():
            cache = run_dir / "cache-interpolation"
            validate_dataset(self.config.data, cache, seed=self.config.data.split_seed)
        corpus = open_corpus(self.config.data, cache)
        self.doc_texts = [text for _, text in corpus.iter_range(0, len(corpus))]
        self.tokenizer = load_tokenizer(self.checkpoint_dir(0))
        self.splits: dict[str, dict[str, dict[int, int]]] = {
            split: getattr(self.dataset, split) for split in SPLITS}
        self.query_texts = dict(self.dataset.queries)
        if heldout_data is not None:
            self._add_heldout(heldout_data)

    def _add_heldout(self, data: Path) -> None:
        """The uncut dataset's training queries outside this run's train and dev splits (same
        corpus file, so the same document rows)."""
        full_cfg = self.config.data.model_copy(update={"path": str(data)})
        full = validate_dataset(full_cfg, self.run_dir / "cache-heldout",
                                seed=self.config.data.split_seed)
        if full.num_docs != self.dataset.num_docs:
            raise SystemExit(f"--heldout-data {data}: {full.num_docs} documents, the run has "
                             f"{self.dataset.num_docs}; not the run's corpus")
        used = set(self.dataset.train) | set(self.dataset.dev)
        self.splits[HELDOUT] = {q: rels for q, rels in full.train.items() if q not in used}
        self.query_texts.update({q: full.queries[q] for q in self.splits[HELDOUT]})

    def checkpoint_dir(self, step: int) -> Path:
        return self.store / keys.checkpoint(step)

    def steps(self) -> list[int]:
        return sorted(int(p.name) for p in (self.store / "checkpoints").iterdir()
                      if p.name.isdigit() and (p / "model.safetensors").is_file())

    def load(self, step: int) -> BiEncoder:
        return BiEncoder.from_pretrained(self.checkpoint_dir(step), self.config.model).eval()

    def metrics(self, model: BiEncoder) -> dict[str, dict[str, float]]:
        model_cfg, inference = self.config.model, self.config.inference
        encoder = prepare_model(model, resolve_precision(inference.precision, "cpu"))
        with torch.inference_mode():
            docs = encode_texts(encoder, self.tokenizer, self.doc_texts, model_cfg.max_doc_length,
                                inference.batch_size, kind="document")
            qids = sorted({q for qrels in self.splits.values() for q in qrels})
            queries = encode_texts(encoder, self.tokenizer, [self.query_texts[q] for q in qids],
                                   model_cfg.max_query_length, inference.batch_size, kind="query")
        # Stored as float16 by the inferencers (inference.embedding_dtype) and read back.
        docs = docs.astype(inference.embedding_dtype).astype(np.float32)
        queries = queries.astype(inference.embedding_dtype).astype(np.float32)
        return evaluate_flat(docs, queries, {q: i for i, q in enumerate(qids)}, self.splits,
                             self.config.index, model_cfg.similarity)

    def stored_metrics(self, step: int) -> dict[str, dict[str, float]] | None:
        path = self.store / "eval" / f"{step}.json"
        return json.loads(path.read_text())["metrics"] if path.is_file() else None


def scan_run(run_dir: Path, alphas: list[float], steps: list[int] | None,
             heldout_data: Path | None = None) -> list[dict]:
    """One row per (checkpoint, α); checkpoint 0 (the starting model, the same at every α)
    once, as α = 1."""
    evaluator = RunEvaluator(run_dir, heldout_data)
    base = {k: v.clone() for k, v in evaluator.load(0).state_dict().items()}
    rows = []
    for step in steps if steps is not None else evaluator.steps():
        tuned = evaluator.load(step)
        tuned_state = {k: v.clone() for k, v in tuned.state_dict().items()}
        for alpha in alphas if step > 0 else [1.0]:
            started = time.monotonic()
            stored = evaluator.stored_metrics(step) if alpha == 1 else None
            if stored is not None and heldout_data is None:
                metrics = stored  # the checkpoint as trained, as the run's indexer evaluated it
            else:
                tuned.load_state_dict(interpolate(base, tuned_state, alpha))
                metrics = evaluator.metrics(tuned)
            rows.append({"run": run_dir.name, "run_dir": str(run_dir), "step": step,
                         "alpha": alpha,
                         **{split: values[MEASURE] for split, values in metrics.items()},
                         "stored": stored or {},
                         "seconds": round(time.monotonic() - started, 1)})
            print(f"[interpolation] {run_dir.name} step {step} α={alpha}: " + ", ".join(
                f"{split} {values[MEASURE]:.4f}" for split, values in metrics.items()),
                flush=True)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Mean nDCG@10 over runs of each split, for each (step, α)."""
    cells: dict[tuple[int, float], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["step"], row["alpha"]), []).append(row)
    return [{"step": step, "alpha": alpha, "runs": len(group),
             **{split: float(np.mean([r[split] for r in group]))
                for split in (*SPLITS, HELDOUT) if split in group[0]}}
            for (step, alpha), group in sorted(cells.items())]


def rule_scores(rows: list[dict], run_dirs: list[Path]) -> list[dict]:
    """How well each checkpoint-selection rule of ``quality.py`` (``--select``) does when it
    reads the run's own dev evaluations (its eval reports' values and bootstrap intervals) and
    is scored on the held-out split at α = 1: per rule, the steps picked and the mean
    held-out and test nDCG@10. Checkpoint 0 is the starting model in every run, so a run
    without its own step-0 row borrows another's."""
    trained = [r for r in rows if r["alpha"] == 1.0 and HELDOUT in r]
    zero = next((r for r in trained if r["step"] == 0), None)
    scores: dict[str, dict[str, list]] = {rule: {"steps": [], HELDOUT: [], "test": []}
                                          for rule in SELECTION_RULES}
    for run_dir in run_dirs:
        by_step = {r["step"]: r for r in trained if r["run_dir"] == str(run_dir)}
        if zero is not None:
            by_step.setdefault(0, zero)
        if len(by_step) < 2:
            continue
        store = run_dir / "store" / load_config(run_dir / "config.yaml").run_id
        dev_queries = len(DatasetIndex.from_json((store / keys.DATASET_INDEX).read_text()).dev)
        refreshes = []
        for step in sorted(by_step):
            stored = json.loads((store / "eval" / f"{step}.json").read_text())
            refreshes.append({"step": step, "metrics": stored["metrics"],
                              "ci95": stored.get("ci95", {})})
        for rule in SELECTION_RULES:
            picked = select_checkpoint(refreshes, rule, dev_queries=dev_queries)
            scores[rule]["steps"].append(picked["step"])
            scores[rule][HELDOUT].append(by_step[picked["step"]][HELDOUT])
            scores[rule]["test"].append(picked["metrics"]["test"][MEASURE])
    return [{"rule": rule, "steps": v["steps"], HELDOUT: float(np.mean(v[HELDOUT])),
             "test": float(np.mean(v["test"]))} for rule, v in scores.items() if v["steps"]]


def render(report: dict) -> str:
    splits = [s for s in (HELDOUT, *SPLITS) if s in report["summary"][0]]
    lines = [f"# Weight interpolation towards the starting model: {report['name']}", "",
             "WiSE-FT (arXiv 2109.01903): θ0 + α (θ − θ0), evaluated as the indexer evaluates "
             "a refresh. α = 0 is zero-shot, α = 1 the checkpoint as trained. Mean nDCG@10 "
             f"over runs ({' / '.join(splits)}); decide on the dev side"
             + (f" ({HELDOUT}: the uncut dataset's training queries the runs did not train on)"
                if HELDOUT in splits else "") + ", never on test.", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {machine_line(report['machine'])}; {report['date']}. Runs: "
             f"{', '.join(report['runs'])}.", ""]
    alphas = sorted({r["alpha"] for r in report["summary"]})
    lines += ["| step | " + " | ".join(f"α = {a:g}" for a in alphas) + " |",
              "|---|" + "---:|" * len(alphas)]
    for step in sorted({r["step"] for r in report["summary"]}):
        cells = {r["alpha"]: r for r in report["summary"] if r["step"] == step}
        lines.append(f"| {step} | " + " | ".join(
            " / ".join(f"{cells[a][s]:.4f}" for s in splits) if a in cells else "–"
            for a in alphas) + " |")
    if report.get("rules"):
        lines += ["", "Checkpoint selection on the runs' own dev split (`quality.py --select`), "
                  f"scored on {HELDOUT} (α = 1; test for reference):", "",
                  f"| rule | steps picked | {HELDOUT} nDCG@10 | test nDCG@10 |",
                  "|---|---|---:|---:|"]
        lines += [f"| {r['rule']} | {r['steps']} | {r[HELDOUT]:.4f} | {r['test']:.4f} |"
                  for r in report["rules"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path,
                        help="Run directories of bench/quality.py --keep-checkpoints.")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="REPORT_JSON",
                        help="Scan nothing: merge the rows of earlier reports (one per run or "
                             "per α) into one summary.")
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--steps", nargs="+", type=int,
                        help="Checkpoints to scan (default: every one, 0 included).")
    parser.add_argument("--heldout-data", type=Path, metavar="DIR",
                        help="The uncut BEIR dataset of a --train-queries run: its other "
                             "training queries become the split 'heldout'.")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own).")
    parser.add_argument("--name", required=True, help="Output file stem.")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args(argv)
    for alpha in args.alphas:
        if not 0.0 <= alpha <= 1.0:
            parser.error(f"--alphas {alpha}: expected a value in [0, 1]")
    if bool(args.runs) == bool(args.combine):
        parser.error("give --runs (scan) or --combine (merge reports), one of them")
    if args.combine:
        parts = [json.loads(path.read_text()) for path in args.combine]
        # A part scans one run directory: its rows name it (older parts name only its leaf).
        rows = [{"run_dir": part["runs"][0], **row} for part in parts for row in part["rows"]]
        run_dirs = list(dict.fromkeys(Path(r) for part in parts for r in part["runs"]))
        report = {"name": args.name, "command": command_line(), "date": utc_now(),
                  "machine": parts[0]["machine"],
                  "parts": [{"command": p["command"], "date": p["date"]} for p in parts]}
    else:
        for run_dir in args.runs:
            if not (run_dir / "config.yaml").is_file():
                parser.error(f"--runs {run_dir}: no config.yaml (not a run directory)")
        if args.threads:
            torch.set_num_threads(args.threads)
        run_dirs = args.runs
        rows = [row for run_dir in run_dirs
                for row in scan_run(run_dir, args.alphas, args.steps, args.heldout_data)]
        report = {"name": args.name, "command": command_line(), "date": utc_now(),
                  "machine": machine("cpu")}
    report.update(runs=[str(r) for r in run_dirs], rows=rows, summary=summarise(rows),
                  rules=rule_scores(rows, run_dirs))
    write_report(args.out, args.name, report, render(report))
    return 0
