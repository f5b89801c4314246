"""A small training world for the data-parallel and GradCache tests: a synthetic dataset with
hard-negative and DANCE tables, a tiny BERT, and a training step written like
``Trainer._optimise`` on top of :func:`ance_train.trainer.step.backward_step`.

The same functions run in the test process (world size 1, the reference) and in each rank
that ``torch.multiprocessing.spawn`` starts (gloo on 127.0.0.1), so the two sides differ only
in the distributed context.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from ance_train.config import ModelConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.modeling.precision import autocast_context
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, uniform_probabilities
from ance_train.trainer.batches import BatchBuilder, TrainingBatch
from ance_train.trainer.distributed import DistributedContext, init_from_env, shard_batch
from ance_train.trainer.step import PairEncoder, backward_step, data_parallel

from ance_train_dev.synthetic import make_tiny_bert

NUM_QUERIES = 40
NUM_DOCS = 120
WORDS = ["aspirin", "heart", "vitamin", "bone", "density", "gene", "expression", "protein",
         "cell", "tumour", "insulin", "blood", "pressure", "virus", "immune", "response",
         "neuron", "brain", "liver", "kidney", "enzyme", "receptor", "signal", "pathway",
         "mutation", "therapy", "dose", "trial", "risk", "cancer", "infection"]


def make_model(directory: Path, dropout: float = 0.0) -> Path:
    """The tiny BERT with its dropout probabilities set (0: deterministic forwards)."""
    make_tiny_bert(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["hidden_dropout_prob"] = dropout
    config["attention_probs_dropout_prob"] = dropout
    config_path.write_text(json.dumps(config))
    return directory


class World:
    """Dataset, texts and negatives tables; query i's positive is document i."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 14))))
                     for _ in range(NUM_DOCS)]
        qids = [f"q{i}" for i in range(NUM_QUERIES)]
        self.dataset = DatasetIndex(
            format="beir", num_docs=NUM_DOCS,
            queries={q: " ".join(self.docs[i].split()[:3]) for i, q in enumerate(qids)},
            train={q: {i: 1} for i, q in enumerate(qids)})
        rows = []
        for i in range(NUM_QUERIES):
            row = rng.choice([d for d in range(NUM_DOCS) if d != i], size=5, replace=False)
            if i % 7 == 3:  # a few short rows: ranks then hold different numbers of docs
                row[2:] = PAD
            rows.append(row)
        candidates = np.array(rows, dtype=np.int64)
        self.table = _table(np.array(qids), candidates)
        # DANCE: negative queries for each positive document, indices into the query ids.
        dual_rows = np.array([rng.choice([q for q in range(NUM_QUERIES) if q != i], size=4,
                                         replace=False) for i in range(NUM_QUERIES)])
        self.dual = _table(np.array([str(i) for i in range(NUM_QUERIES)]), dual_rows,
                           candidate_query_ids=np.array(qids))

    def batches(self, batch_size: int, seed: int = 3) -> BatchBuilder:
        return BatchBuilder(self.dataset, batch_size, 2, True, seed)

    def build(self, builder: BatchBuilder, dance: bool) -> TrainingBatch:
        return builder.build(self.table, self.dual if dance else None, 2)


def _table(keys: np.ndarray, candidates: np.ndarray,
           candidate_query_ids: np.ndarray | None = None) -> NegativesTable:
    return NegativesTable(
        step=1, query_ids=keys, candidates=candidates,
        scores=np.zeros(candidates.shape, np.float32),
        positive_scores=np.zeros(len(keys), np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8),
        candidate_query_ids=candidate_query_ids)


class Learner:
    """Model, optimiser and the trainer's step (zero_grad, backward_step, clip, update)."""

    def __init__(self, model_dir: Path, context: DistributedContext, lr: float = 1e-3,
                 precision: str = "off") -> None:
        torch.manual_seed(0)
        self.context = context
        self.tokenizer = load_tokenizer(model_dir)
        self.model = BiEncoder.from_pretrained(model_dir, ModelConfig(path=str(model_dir)))
        self.encoder = data_parallel(PairEncoder(self.model), context)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.autocast = functools.partial(autocast_context, precision, torch.device("cpu"))

    def backward(self, world: World, batch: TrainingBatch, chunk: int | None,
                 dual_weight: float = 0.5) -> tuple[float, float | None]:
        self.model.train()
        shard = shard_batch(batch, self.context.rank, self.context.world_size)
        queries = self.tokenizer(shard.query_texts + shard.dual_query_texts, padding=True,
                                 return_tensors="pt")
        docs = self.tokenizer([world.docs[d] for d in shard.doc_indices], padding=True,
                              return_tensors="pt")
        self.optimizer.zero_grad(set_to_none=True)
        return backward_step(self.encoder, shard,
                             (queries["input_ids"], queries["attention_mask"]),
                             (docs["input_ids"], docs["attention_mask"]), self.context,
                             dual_weight if batch.dual_allowed is not None else 0.0,
                             self.autocast, chunk)

    def step(self, world: World, batch: TrainingBatch, chunk: int | None = None,
             ) -> tuple[float, float | None]:
        losses = self.backward(world, batch, chunk)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.optimizer.step()
        return losses

    def gradients(self) -> dict[str, torch.Tensor]:
        return {name: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
                for name, p in self.model.named_parameters()}

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


STEPS = 5
GLOBAL_BATCH = 16
GRAD_BATCH = 8
CHUNKS = (None, 1, 3, GRAD_BATCH * 4)  # off, one row, three rows, more than any shard


def scenarios(model_dir: Path, context: DistributedContext) -> dict:
    """Everything the tests compare between one process and two ranks."""
    world = World()
    out: dict = {}
    for dance in (False, True):
        # 5 steps over a global batch of 16 with hard and in-batch negatives (+ DANCE).
        learner = Learner(model_dir, context)
        builder = world.batches(GLOBAL_BATCH)
        losses = [learner.step(world, world.build(builder, dance)) for _ in range(STEPS)]
        out[f"train/dance={dance}"] = {"losses": losses, "weights": learner.weights()}
        # One step's loss and gradients, plain and with GradCache.
        for chunk in CHUNKS:
            learner = Learner(model_dir, context)
            batch = world.build(world.batches(GRAD_BATCH), dance)
            loss = learner.backward(world, batch, chunk)
            out[f"grad/dance={dance}/chunk={chunk}"] = {"loss": loss,
                                                        "grads": learner.gradients()}
    return out


class _HideNoSync(torch.nn.Module):
    """A DDP model seen without its ``no_sync`` (what a GradCache without it would do)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.ddp = ddp
        self.module = ddp.module

    def forward(self, *args):
        return self.ddp(*args)


def count_allreduces(model_dir: Path, context: DistributedContext) -> dict:
    """Gradient all-reduces per step (a DDP communication hook counts the bucket calls)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    world = World()
    learner = Learner(model_dir, context)
    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    learner.encoder.register_comm_hook(None, hook)
    builder = world.batches(GRAD_BATCH)
    counts: dict[str, list[int]] = {"plain": [], "grad_cache": [], "without_no_sync": []}
    for kind, chunk in (("plain", None), ("plain", None), ("grad_cache", 1),
                        ("grad_cache", 3), ("without_no_sync", 1)):
        ddp = learner.encoder
        if kind == "without_no_sync":
            learner.encoder = _HideNoSync(ddp)
        calls[0] = 0
        learner.step(world, world.build(builder, dance=True), chunk)
        counts[kind].append(calls[0])
        learner.encoder = ddp
    return counts


def rank_main(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    """Entry point of a spawned rank: join the group from torchrun-style variables, run the
    scenarios, save what rank 0 (and, for the comparisons across ranks, rank 1) saw."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    context = init_from_env(backend="gloo")
    try:
        results = scenarios(Path(model_dir), context)
        results["allreduces"] = count_allreduces(Path(model_dir), context)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()
