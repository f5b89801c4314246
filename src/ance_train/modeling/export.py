"""``ance-train export``: one checkpoint of a run as a sentence-transformers model directory
with a Hugging Face model card.

The checkpoint (``checkpoints/<step>/`` in the run's store, either backend) already is a
transformers + sentence-transformers directory; the export copies it without the trainer's
resume state and adds ``README.md`` (the card: metadata block with ``model-index`` holding the
checkpoint's dev/test metrics from ``eval/<step>.json``, the training configuration, the
method and its paper, how it was evaluated), ``ance_train_config.yaml`` (the run's
configuration) and ``eval_results.json`` (the eval report, as the indexer wrote it).

``--push-to-hub REPO`` then uploads the directory to a Hugging Face Hub model repo
(:func:`push_export`: ``HfApi.create_repo`` + ``upload_folder``; ``HF_ENDPOINT`` and
``HF_TOKEN`` as huggingface_hub reads them).

``best`` is the checkpoint dev selects (:mod:`ance_train.protocol.selection`: the highest dev
nDCG@10, or with a dev split under 50 queries the latest within its noise; never test: the
test split is only reported); ``last`` the newest checkpoint whose model is stored (its
``WEIGHTS.json``: the training state, which the export leaves out, need not be); a number
that exact step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import yaml

from ance_train.config import (
    MIN_DEV_QUERIES,
    ConfigError,
    RunConfig,
    default_model_path,
    parse_config,
)
from ance_train.data.dataset import DatasetIndex
from ance_train.infra.store import ObjectNotFound, ObjectStore
from ance_train.modeling.checkpoint_cache import download_model
from ance_train.modeling.model import META_FILE
from ance_train.protocol import keys
from ance_train.protocol.checkpoints import loadable_checkpoints
from ance_train.protocol.retention import BEST_MEASURE, BEST_SPLIT
from ance_train.protocol.selection import DevPoint, interval, select_on_dev

if TYPE_CHECKING:
    from ance_train.config import NegativesConfig
    from ance_train.negatives.strategies.dance import DanceLoss

CONFIG_FILE = "ance_train_config.yaml"
EVAL_FILE = "eval_results.json"
# Measures of the eval reports as model-index metric types and display names.
MEASURE_NAMES = {"ndcg@10": ("ndcg_at_10", "nDCG@10"), "mrr@10": ("mrr_at_10", "MRR@10"),
                 "recall@100": ("recall_at_100", "Recall@100"),
                 "recall@1000": ("recall_at_1000", "Recall@1000")}
BEIR_DATASETS = {"scifact", "nfcorpus", "fiqa", "trec-covid", "arguana", "scidocs", "quora",
                 "nq", "hotpotqa", "fever", "climate-fever", "dbpedia-entity", "touche2020",
                 "webis-touche2020", "cqadupstack", "msmarco", "signal1m", "trec-news",
                 "robust04", "bioasq"}


@dataclass(frozen=True)
class Paper:
    name: str
    title: str
    venue: str
    arxiv: str

    def cite(self) -> str:
        return (f"{self.name}: \"{self.title}\", {self.venue}, "
                f"[arXiv:{self.arxiv}](https://arxiv.org/abs/{self.arxiv})")


ANCE = Paper("ANCE", "Approximate Nearest Neighbor Negative Contrastive Learning for Dense Text "
             "Retrieval", "ICLR 2021", "2007.00808")
DANCE = Paper("DANCE", "More Robust Dense Retrieval with Contrastive Dual Learning", "ICTIR 2021",
              "2107.07773")
SIMANS = Paper("SimANS", "SimANS: Simple Ambiguous Negatives Sampling for Dense Text Retrieval",
               "EMNLP 2022 (Industry Track)", "2210.11773")
TELE = Paper("ANCE-Tele", "Reduce Catastrophic Forgetting of Dense Retrieval Training with "
             "Teleportation Negatives", "EMNLP 2022", "2210.17167")
DPR = Paper("DPR", "Dense Passage Retrieval for Open-Domain Question Answering", "EMNLP 2020",
            "2004.04906")
POOL_PAPERS = {"ann": ANCE, "tele": TELE, "in_batch": DPR, "random": DPR, "bm25": DPR,
               "bm25_random": DPR}


class ExportError(ValueError):
    """The run, checkpoint or output directory cannot be exported; the message says which."""


def exportable_checkpoints(store: ObjectStore) -> list[int]:
    """Steps of the checkpoints whose model is stored whole (their WEIGHTS.json or
    MANIFEST.json is: :mod:`ance_train.protocol.checkpoints`), ascending."""
    return loadable_checkpoints(store.list(keys.CHECKPOINTS))


def eval_reports(store: ObjectStore) -> dict[int, dict]:
    """Every ``eval/<step>.json`` of the run, by step."""
    reports = {}
    for key in store.list(keys.EVAL_REPORTS):
        step = keys.eval_report_step(key)
        if step is not None:
            reports[step] = store.get_json(key)
    return reports


def dev_queries(store: ObjectStore) -> int | None:
    """The dev split's query count, from the run's dataset index (None: not stored)."""
    try:
        index = DatasetIndex.from_json(store.get_bytes(keys.DATASET_INDEX).decode())
    except ObjectNotFound:
        return None
    return len(index.dev)


def select_checkpoint(store: ObjectStore, which: str) -> int:
    """``best`` (the dev selection of :mod:`ance_train.protocol.selection`: the highest dev
    nDCG@10, or with a dev split too small to tell checkpoints apart the latest within its
    noise), ``last`` or a step number → a complete checkpoint."""
    run = store.run_id
    steps = exportable_checkpoints(store)
    if not steps:
        raise ExportError(f"run {run!r} has no complete checkpoint in {store!r}")
    if which == "last":
        return steps[-1]
    if which == "best":
        points = [DevPoint(step, report["metrics"][BEST_SPLIT][BEST_MEASURE],
                           interval(report.get("ci95", {}).get(BEST_SPLIT, {}).get(BEST_MEASURE)))
                  for step, report in sorted(eval_reports(store).items())
                  if step in steps and BEST_MEASURE in report.get("metrics", {}).get(
                      BEST_SPLIT, {})]
        if not points:
            raise ExportError(
                f"run {run!r}: no checkpoint has {BEST_SPLIT} {BEST_MEASURE} in its eval report, "
                f"so there is no best one (best is chosen on {BEST_SPLIT}, never on test; "
                f"give index.eval_splits a dev split and a dev split to the data (official "
                f"dev qrels, or data.dev_fraction > 0), or export "
                f"--checkpoint last or a step)")
        return select_on_dev(points, dev_queries(store))
    try:
        step = int(which)
    except ValueError:
        raise ExportError(f"--checkpoint must be best, last or a step number, got {which!r}"
                          ) from None
    if step not in steps:
        raise ExportError(f"run {run!r} has no complete checkpoint {step}; its checkpoints: "
                          f"{', '.join(map(str, steps))}")
    return step


def run_config(store: ObjectStore, fallback: RunConfig | None) -> RunConfig | None:
    """The configuration the trainer stored for the run (else ``fallback``)."""
    try:
        raw = yaml.safe_load(store.get_bytes(keys.RUN_CONFIG))
    except ObjectNotFound:
        return fallback
    try:
        return parse_config(raw, f"{keys.RUN_CONFIG} of run {store.run_id}")
    except ConfigError:
        return fallback


def export_checkpoint(store: ObjectStore, which: str, out: Path,
                      config: RunConfig | None = None, overwrite: bool = False) -> tuple[int, Path]:
    """Write checkpoint ``which`` of the run into ``out``; returns its step and ``out``."""
    step = select_checkpoint(store, which)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty; pass --overwrite to replace "
                          f"it")
    config = run_config(store, config)
    report = eval_reports(store).get(step)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out.parent.is_dir()
                                    else None))
    try:
        download_model(store, step, staging)
        meta = json.loads((staging / META_FILE).read_text()) if (
            staging / META_FILE).is_file() else {}
        if meta.get("projection_dim"):
            raise ExportError(
                f"checkpoint {step} of run {store.run_id!r} has ANCE's projection head "
                f"(model.projection_dim {meta['projection_dim']}), which its "
                f"sentence-transformers modules do not apply: it cannot be exported as a "
                f"sentence-transformers model (load it with ance_train's BiEncoder)")
        if config is not None:
            (staging / CONFIG_FILE).write_text(
                yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        if report is not None:
            (staging / EVAL_FILE).write_text(json.dumps(report, indent=2))
        (staging / "README.md").write_text(model_card(store.run_id, step, config, report, meta,
                                                      selected=which))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(out))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step, out


def push_export(directory: Path, repo_id: str, private: bool = False,
                message: str = "ance-train export") -> str:
    """Upload an exported model directory to the Hub model repo ``repo_id`` (created when
    missing); returns the commit's URL. Errors become :class:`ExportError` naming the repo."""
    from huggingface_hub import HfApi

    # errors.HTTPError: the HTTP client's base error (connection failures, HfHubHTTPError).
    from huggingface_hub.errors import HFValidationError, HTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, repo_type="model",
                                   folder_path=str(directory), commit_message=message)
    except (HTTPError, HFValidationError, LocalTokenNotFoundError) as error:
        raise ExportError(f"cannot push {directory} to the Hub repo {repo_id!r} "
                          f"({api.endpoint}): {error}") from None
    return str(commit.commit_url)


# -- the model card -------------------------------------------------------------------------
def base_model(config: RunConfig | None) -> str | None:
    """The Hub id of the model training started from, where it can be told."""
    if config is None:
        return None
    if config.model.source_kind == "hub":
        return config.model.path
    if config.model.source_kind == "s3":
        return None
    path = Path(config.model.path)
    if path.resolve() == Path(default_model_path()).resolve():
        return "sentence-transformers/all-MiniLM-L6-v2"
    try:  # a model saved after loading it from the Hub records its Hub id
        recorded = json.loads((path / "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        recorded = ""
    if (isinstance(recorded, str) and recorded.count("/") == 1 and not recorded.startswith(".")
            and not Path(recorded).is_absolute()):
        return recorded
    return path.name or None


def dataset_name(config: RunConfig | None) -> str | None:
    if config is None:
        return None
    name = Path(config.data.path).name
    if config.data.format == "msmarco":
        return "microsoft/ms_marco"
    return f"BeIR/{name}" if name.lower() in BEIR_DATASETS else name


def _dance(neg: NegativesConfig) -> DanceLoss:
    # The cast: the strategy registered as "dance" is DanceLoss.
    return cast("DanceLoss", neg.strategy("dance"))


def papers(config: RunConfig | None) -> list[Paper]:
    if config is None:
        return []
    neg = config.negatives
    found = [POOL_PAPERS.get(neg.pool, ANCE)]
    if neg.sampling == "simans":
        found.append(SIMANS)
    if _dance(neg).enabled:
        found.append(DANCE)
    if neg.warmup != "none" and DPR not in found:
        found.append(DPR)
    return list(dict.fromkeys(found))


def method(config: RunConfig) -> str:
    neg, train = config.negatives, config.training
    parts = [f"negatives from pool `{neg.pool}` sampled `{neg.sampling}`, {neg.per_query} per "
             f"query (top {neg.top_k})"]
    if neg.warmup != "none":
        parts.append(f"warm-up on `{neg.warmup}` negatives")
    if _dance(neg).enabled:
        parts.append(f"DANCE dual loss λ = {_dance(neg).weight}")
    parts.append("in-batch negatives" if train.in_batch_negatives else "no in-batch negatives")
    return "; ".join(parts)


def model_index(name: str, dataset: str | None, report: dict | None) -> list[dict]:
    results = []
    for split, values in (report or {}).get("metrics", {}).items():
        metrics = [{"type": MEASURE_NAMES.get(m, (m.replace("@", "_at_"), m))[0],
                    "name": MEASURE_NAMES.get(m, (m, m))[1], "value": float(v)}
                   for m, v in values.items()]
        results.append({"task": {"type": "retrieval", "name": "Retrieval"},
                        "dataset": {"type": dataset or "unknown", "name": f"{dataset} ({split})",
                                    "split": split},
                        "metrics": metrics})
    return [{"name": name, "results": results}]


def model_card(run_id: str, step: int, config: RunConfig | None, report: dict | None,
               meta: dict, selected: str = "") -> str:
    dataset = dataset_name(config)
    base = base_model(config)
    name = f"{run_id}-step-{step}"
    metadata: dict = {"library_name": "sentence-transformers",
                      "pipeline_tag": "sentence-similarity"}
    if base is not None:
        metadata["base_model"] = base
    metadata["tags"] = ["sentence-transformers", "sentence-similarity", "feature-extraction",
                        "dense-retrieval", "ance-train",
                        *[p.name.lower() for p in papers(config)]]
    if dataset is not None:
        metadata["datasets"] = [dataset]
    if report is not None and report.get("metrics"):
        metadata["model-index"] = model_index(name, dataset, report)
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).rstrip(), "---", "",
             f"# {name}", "",
             f"A dense retriever (bi-encoder: one encoder for queries and documents) trained "
             f"with ance-train, run `{run_id}`, checkpoint of step "
             f"{step}" + (f", starting from `{base}`" if base else "") + ".", ""]
    if selected == "best":
        lines += [f"Exported as the run's best checkpoint, chosen on {BEST_SPLIT} {BEST_MEASURE} "
                  f"(never on test): the highest of its evaluated checkpoints or, with fewer "
                  f"than {MIN_DEV_QUERIES} {BEST_SPLIT} queries, the latest within the "
                  f"bootstrap 95% interval of the highest.", ""]
    elif selected == "last":
        lines += ["Exported as the run's last checkpoint.", ""]
    lines += ["## Usage", "", "```python", "from sentence_transformers import SentenceTransformer",
              "", "model = SentenceTransformer(\"path/to/this/directory\")",
              "queries = model.encode([\"what causes ...?\"])",
              "docs = model.encode([\"a passage ...\"])",
              f"scores = queries @ docs.T  # similarity: {meta.get('similarity', 'dot')}",
              "```", "",
              f"Pooling: {meta.get('pooling', 'mean')}; similarity: "
              f"{meta.get('similarity', 'dot')}"
              + (" (embeddings are L2-normalised)" if meta.get("similarity") == "cosine" else "")
              + f"; temperature in training: {meta.get('temperature', 1.0)}.", ""]
    if config is not None:
        lines += ["## Method", "",
                  "Trained with globally mined, asynchronously refreshed hard negatives: every "
                  f"{config.training.refresh_every} steps the trainer publishes a checkpoint, "
                  "inferencers re-encode the corpus with it, and the indexer builds an ANN index "
                  "and mines new negatives from it while training goes on.", "",
                  f"This run: {method(config)}.", "", "Papers:", ""]
        lines += [f"- {p.cite()}" for p in papers(config)]
        lines += ["", "## Training configuration", "",
                  "| setting | value |", "| --- | --- |"]
        train = config.training
        steps = train.steps if train.epochs is None else f"{train.epochs} epochs"
        rows = [("steps", steps), ("batch size", train.batch_size),
                ("learning rate", train.learning_rate), ("warm-up steps", train.warmup_steps),
                ("weight decay", train.weight_decay), ("max grad norm", train.max_grad_norm),
                ("refresh every", train.refresh_every), ("seed", train.seed),
                ("max query / doc length",
                 f"{config.model.max_query_length} / {config.model.max_doc_length}"),
                ("negatives", method(config))]
        lines += [f"| {k} | {v} |" for k, v in rows]
        lines += ["", f"The whole configuration is in `{CONFIG_FILE}`.", ""]
    lines += ["## Evaluation", ""]
    if report is None:
        lines += [f"Checkpoint {step} has no evaluation report.", ""]
    else:
        depth = config.index.eval_depth if config is not None else "the configured"
        index = (f"a `{config.index.type}` index" if config is not None else "an ANN index")
        lines += [f"The indexer evaluated checkpoint {step} by retrieval over the whole corpus "
                  f"({index} of this checkpoint's embeddings, top {depth}), measured with "
                  "ir-measures. `dev` is " + _dev_source(config)
                  + "; `test` is the dataset's test qrels, reported only: checkpoints are "
                  f"selected on dev {BEST_MEASURE}, never on test.", ""]
        measures = list(dict.fromkeys(m for values in report["metrics"].values() for m in values))
        lines += ["| split | " + " | ".join(MEASURE_NAMES.get(m, (m, m))[1] for m in measures)
                  + " |", "| --- |" + " --- |" * len(measures)]
        for split, values in report["metrics"].items():
            lines.append(f"| {split} | " + " | ".join(
                f"{values[m]:.4f}" if m in values else "" for m in measures) + " |")
        lines += ["", f"The full report is in `{EVAL_FILE}`.", ""]
    return "\n".join(lines)


def _dev_source(config: RunConfig | None) -> str:
    """Where the dev queries came from (``data.dev_split``), for the model card."""
    if config is None:
        return "the run's dev split"
    data = config.data
    sliced = (f"a held-out slice of the training queries ({data.dev_fraction:.0%}, at most "
              f"{data.dev_max_queries}, split seed {data.split_seed})")
    named = data.dev_qrels or "the dataset's dev qrels file"
    if data.dev_split == "train":
        return sliced
    if data.dev_split == "qrels" or data.dev_qrels is not None:
        return f"the dev qrels ({named})"
    return f"{named} when the dataset has one (BEIR qrels/dev.tsv), else {sliced}"
