"""The peer a user would run instead of this system: sentence-transformers with static hard
negatives, as a method of ``bench/quality.py`` (``--methods st-static``).

The recipe (sentence-transformers' own, SBERT docs "Hard negatives mining" + "MultipleNegatives-
RankingLoss"): mine hard negatives **once** with the zero-shot model
(``util.mine_hard_negatives(range_max=20, num_negatives=1, sampling_strategy="random")`` over the
whole corpus, one triplet per (training query, positive) pair), then fine-tune with
``MultipleNegativesRankingLoss`` (scale 20, cosine; in-batch negatives plus the mined one)
through ``SentenceTransformerTrainer`` with the no-duplicates batch sampler.

Everything else is the other methods' (the config ``quality.py`` builds for them): the same
validated dataset and split (``validate_dataset`` with ``data.split_seed``), steps, queries per
step, learning rate, linear warm-up/decay, weight decay, gradient clipping, query and document
token limits, seed, checkpoints at every ``training.refresh_every`` steps (and step 0, the
zero-shot model). Each checkpoint's corpus and query embeddings are stored in the layout the
indexer's refreshes use (``store/<run>/embeddings/<step>/``) and evaluated by the indexer's own
code path (a flat ``AnnIndex``, ``index.eval_depth``, ``ance_train.evaluation.evaluate``), so
``bench/significance.py`` rebuilds its rankings like any other run's.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ance_train.config import DataConfig, IndexConfig, default_model_path
from ance_train.data.corpus import open_corpus
from ance_train.data.dataset import DatasetIndex
from ance_train.data.validation import validate_dataset
from ance_train.modeling.encoding import resolve_precision
from ance_train.modeling.precision import autocast_dtype
from ance_train.protocol import keys
from ance_train.protocol.embeddings import pack_embeddings, unpack_embeddings
from ance_train.protocol.work import query_order

from ance_train_dev.stored_run import evaluate_flat

METHOD = "st-static"
RANGE_MAX = 20          # the recipe: negatives drawn from the zero-shot top 20
SCALE = 20.0            # MNRL's default scale = 1 / temperature 0.05 (ance.yaml)
EVAL_SPLITS = ("dev", "test")


def _collator(model: Any, lengths: dict[str, int]) -> Any:
    """sentence-transformers' collator with one token limit per column (the query limit for
    the anchor, the document limit for positives and negatives), as this system's trainer
    truncates queries and documents separately."""
    from sentence_transformers.sentence_transformer.data_collator import (
        SentenceTransformerDataCollator,
    )

    @dataclass
    class PerColumnLength(SentenceTransformerDataCollator):
        column_lengths: dict[str, int] = field(default_factory=dict)

        def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
            batch: dict[str, Any] = {}
            for column in features[0]:
                encoded = self.preprocess_fn([row[column] for row in features],
                                             max_length=self.column_lengths[column])
                for key, value in encoded.items():
                    batch[f"{column}_{key}"] = value
            return batch

    return PerColumnLength(preprocess_fn=model.preprocess, column_lengths=lengths)


def index_similarity(model_cfg: dict) -> str:
    """The similarity of the index the peer's checkpoints are evaluated with: the model's own,
    since sentence-transformers' vectors are stored as encoded, not normalised (the indexer
    instead takes a cosine model's unit vectors with ``dot``)."""
    return model_cfg.get("similarity", "cosine")


def _encode(model: Any, texts: list[str], max_length: int, batch_size: int) -> np.ndarray:
    model.max_seq_length = max_length
    vectors = model.encode(texts, batch_size=batch_size, convert_to_tensor=True,
                           normalize_embeddings=False, show_progress_bar=False)
    return vectors.float().cpu().numpy()


class _Checkpoints:
    """Encodes and evaluates the model at step 0 and every ``every`` steps (and the last)."""

    def __init__(self, config: dict, dataset: DatasetIndex, doc_texts: list[str],
                 store: Path) -> None:
        self.config, self.dataset, self.doc_texts, self.store = config, dataset, doc_texts, store
        self.qids = query_order(dataset)
        self.evaluations: list[dict] = []
        self.seconds = 0.0
        self.precision = "fp32"

    def __call__(self, model: Any, step: int) -> dict:
        started = time.monotonic()
        model_cfg, inference = self.config["model"], self.config["inference"]
        batch = int(inference.get("batch_size", 32))
        was_training = model.training
        # The inferencers' precision (inference.precision: auto = bf16 where the hardware
        # computes it natively) on a copy, as encoding.prepare_model does; the trained model
        # stays fp32.
        precision = resolve_precision(inference.get("precision", "auto"), model.device)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"{METHOD}: inference.precision {precision} is not supported")
        encoder = model if precision == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
        docs = _encode(encoder, self.doc_texts, model_cfg["max_doc_length"], batch)
        queries = _encode(encoder, [self.dataset.queries[q] for q in self.qids],
                          model_cfg["max_query_length"], batch)
        del encoder
        model.train(was_training)
        # Stored as the inferencers store them (inference.embedding_dtype) and evaluated from
        # what was stored, as the indexer reads it.
        dtype = inference.get("embedding_dtype", "float16")
        shards = self.store / keys.embeddings(step)
        shards.mkdir(parents=True, exist_ok=True)
        corpus_bytes = pack_embeddings(np.arange(len(docs), dtype=np.int64), docs, dtype)
        query_bytes = pack_embeddings(np.array(self.qids), queries, dtype)
        (shards / "corpus-00000.npz").write_bytes(corpus_bytes)
        (shards / "queries-00000.npz").write_bytes(query_bytes)
        docs, queries = unpack_embeddings(corpus_bytes)[1], unpack_embeddings(query_bytes)[1]
        self.precision = precision
        splits = {split: getattr(self.dataset, split) for split in EVAL_SPLITS
                  if getattr(self.dataset, split)}  # what the indexer's evaluate does
        metrics = evaluate_flat(docs, queries, {q: i for i, q in enumerate(self.qids)}, splits,
                                IndexConfig(**self.config.get("index", {})),
                                index_similarity(model_cfg))
        record = {"step": step, "metrics": metrics}
        (self.store / "eval").mkdir(exist_ok=True)
        (self.store / "eval" / f"{step}.json").write_text(
            json.dumps({**record, "diagnostics": {}}))
        self.evaluations.append(record)
        self.seconds += time.monotonic() - started
        return record


def _threads(config: dict) -> int | None:
    """The CPU threads the embedded run of the same profile uses in all (trainer plus every
    inferencer), at most the machine's cores, so that wall times compare on the same cores;
    None = torch's default."""
    training, inference = config["training"], config["inference"]
    if training.get("torch_threads") is None or inference.get("torch_threads") is None:
        return None
    used = int(training["torch_threads"]) + int(inference.get("replicas", 1)) * int(
        inference["torch_threads"])
    return min(used, os.cpu_count() or used)


def train_peer(config: dict, run_dir: Path) -> dict:
    """Mine once, train with MNRL, evaluate every checkpoint; write and return the run's
    ``summary.json`` (the fields ``quality.run_method`` reads from an embedded run's)."""
    threads = _threads(config)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(config, run_dir, threads)
    finally:
        torch.set_num_threads(before)  # the caller's process goes on (tests run it in process)


def _train(config: dict, run_dir: Path, threads: int | None) -> dict:
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from sentence_transformers.util import mine_hard_negatives
    from transformers import TrainerCallback, set_seed

    started = time.monotonic()
    run_id, training, model_cfg = config["run_id"], config["training"], config["model"]
    seed = int(training["seed"])
    store = run_dir / "store" / run_id
    cache = run_dir / "work" / "data"
    data_cfg = DataConfig(**config["data"])
    dataset = validate_dataset(data_cfg, cache, seed=data_cfg.split_seed)
    (store / keys.DATASET_INDEX).parent.mkdir(parents=True, exist_ok=True)
    (store / keys.DATASET_INDEX).write_text(dataset.to_json())
    corpus = open_corpus(data_cfg, cache)
    doc_texts = [text for _, text in corpus.iter_range(0, len(corpus))]

    set_seed(seed)
    random.seed(seed)
    model = SentenceTransformer(model_cfg.get("path") or default_model_path(),
                                device="cuda" if torch.cuda.is_available() else "cpu")
    checkpoints = _Checkpoints(config, dataset, doc_texts, store)
    checkpoints(model, 0)

    # One (query, positive) pair per training judgement, as a user feeds the miner.
    pairs = [(dataset.queries[q], doc_texts[d]) for q in sorted(dataset.train)
             for d in dataset.positives(q)]
    mining_started = time.monotonic()
    model.max_seq_length = model_cfg["max_doc_length"]  # one limit for both, as users mine
    triplets = mine_hard_negatives(
        Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]}),
        model, corpus=doc_texts, range_max=RANGE_MAX, num_negatives=1,
        sampling_strategy="random", batch_size=int(config["inference"].get("batch_size", 32)),
        output_format="triplet", verbose=False)
    mining_seconds = time.monotonic() - mining_started

    every, steps = int(training["refresh_every"]), int(training["steps"])

    class Evaluate(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % every == 0 or state.global_step == steps:
                checkpoints(model, state.global_step)

    cuda = torch.cuda.is_available()
    # The trainer's own mixed-precision policy (auto: bf16 on a CUDA device with bf16, else
    # full precision), carried out by the Trainer's autocast.
    autocast = autocast_dtype(training.get("mixed_precision", "auto"), model.device)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(run_dir / "work" / "trainer"), max_steps=steps,
        per_device_train_batch_size=int(training["batch_size"]),
        learning_rate=float(training["learning_rate"]),
        warmup_steps=int(training["warmup_steps"]), lr_scheduler_type="linear",
        weight_decay=float(training.get("weight_decay", 0.01)),
        max_grad_norm=float(training.get("max_grad_norm", 2.0)),
        seed=seed, data_seed=seed, bf16=autocast == torch.bfloat16,
        fp16=autocast == torch.float16,
        batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", logging_steps=1,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, use_cpu=not cuda)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=triplets,
        loss=MultipleNegativesRankingLoss(model, scale=SCALE),
        data_collator=_collator(model, {"anchor": model_cfg["max_query_length"],
                                        "positive": model_cfg["max_doc_length"],
                                        "negative": model_cfg["max_doc_length"]}),
        callbacks=[Evaluate()])
    training_started = time.monotonic()
    eval_before = checkpoints.seconds
    trainer.train()
    training_seconds = time.monotonic() - training_started - (checkpoints.seconds - eval_before)
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "method": METHOD, "seconds": time.monotonic() - started,
        "evaluations": checkpoints.evaluations,
        "peer": {"mining_seconds": mining_seconds, "training_seconds": training_seconds,
                 "evaluation_seconds": checkpoints.seconds, "triplets": len(triplets),
                 "pairs": len(pairs), "threads": threads or torch.get_num_threads(),
                 "evaluation_precision": checkpoints.precision,
                 "range_max": RANGE_MAX, "scale": SCALE},
        "trainer": {"finished": trainer.state.global_step == steps,
                    "steps": trainer.state.global_step, "losses": losses, "swaps": []},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
