"""One-batch lookahead: the next batch's texts are read and tokenised while this step computes.

Rank 0 builds global batch s+1 (negatives drawn, columns and masks laid out) and sends it to
the other ranks *before* it optimises step s; every rank hands its slice of batch s+1 to a
:class:`BatchPreparer`, whose single background thread reads the documents' texts from the
corpus and tokenises queries and documents while the loop's thread runs step s's forward and
backward. Hugging Face fast tokenizers encode a batch in Rust with the GIL released, and
torch's kernels release it too, so the two really run side by side: adding ranks or GPUs is
not capped by one thread's tokenisation on the critical path.

What the lookahead changes, and how it stays exact:

* the negatives table batch s+1 draws from is the one held when it was built (before step s,
  not after): the batch carries its table (:class:`PlannedBatch`), and the swap, the table
  step and the async gap are recorded at the step that trains on it;
* a checkpoint at step s is written after batch s+1 was built, so the batch sampler in it has
  moved on: the checkpoint stores batch s+1 itself (``TrainingState.lookahead``) and a
  resumed run trains on it first, as the uninterrupted run did;
* only the loop's thread draws from the global RNGs (the preparation draws nothing), so the
  losses are those of the sequential order (``tests/test_prefetch.py``).

The preparer owns a tokenizer of its own: a fast tokenizer is one Rust object that refuses to
be borrowed twice at once ("Already borrowed"), and the loop's thread saves the trainer's
tokenizer into every checkpoint. In the trainer process the worker is the only reader of the
corpus file handle.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ance_train.data.corpus import Corpus
from ance_train.modeling.model import tokenize
from ance_train.modeling.passages import PassageSplitter
from ance_train.trainer.batches import TrainingBatch
from ance_train.trainer.distributed import RankShard, shard_batch

log = logging.getLogger(__name__)


@dataclass
class PlannedBatch:
    """A global batch as rank 0 built it, with what the summary records about it at the step
    that trains on it (not the step during which it was built)."""

    step: int                       # the step that trains on it
    batch: TrainingBatch
    table_step: int | None          # reported step of its negatives table (-1: BM25; None)
    mined_at: int | None            # checkpoint step that mined that table (ANN; async gap)
    negatives_ms: float             # choosing the source + drawing + assembling the batch

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors (``training_state``'s pickle-free format)."""
        return {"step": self.step, "batch": asdict(self.batch), "table_step": self.table_step,
                "mined_at": self.mined_at, "negatives_ms": self.negatives_ms}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PlannedBatch:
        return cls(step=int(state["step"]), batch=TrainingBatch(**state["batch"]),
                   table_step=state["table_step"], mined_at=state["mined_at"],
                   negatives_ms=float(state["negatives_ms"]))


@dataclass
class StepInputs:
    """This rank's slice of a batch, tokenised (CPU tensors), and what preparing it cost."""

    shard: RankShard
    query_ids: torch.Tensor
    query_mask: torch.Tensor
    doc_ids: torch.Tensor
    doc_mask: torch.Tensor
    prepare_ms: float               # reading texts + tokenising, on the worker
    wait_ms: float = 0.0            # how long the loop blocked on it (``BatchPreparer.result``)


class BatchPreparer:
    """Reads and tokenises this rank's slice of planned batches on one background thread.

    ``background=False`` prepares at ``submit``, on the caller's thread (the sequential order;
    ``bench/trainer_overhead.py`` compares the two). Call :meth:`close` when the loop ends.
    ``query_prompt`` / ``document_prompt`` are prepended to queries (dual ones too) and
    documents, as every other encoding does (``model.query_prompt``, ``model.document_prompt``).
    """

    def __init__(self, tokenizer: Any, corpus: Corpus, max_query_length: int,
                 max_doc_length: int, rank: int = 0, world_size: int = 1,
                 background: bool = True, query_prompt: str = "",
                 document_prompt: str = "", passages: PassageSplitter | None = None) -> None:
        self.tokenizer = tokenizer
        self.passages = passages  # MaxP: documents are encoded as their chosen passage
        self.query_prompt = query_prompt
        self.document_prompt = document_prompt
        self.corpus = corpus
        self.max_query_length = max_query_length
        self.max_doc_length = passages.length if passages is not None else max_doc_length
        self.rank = rank
        self.world_size = world_size
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch")
                          if background else None)
        self._unread: set[Future] = set()

    def prepare(self, planned: PlannedBatch) -> StepInputs:
        """The work itself: slice, read the documents' texts, tokenise."""
        started = time.perf_counter()
        shard = shard_batch(planned.batch, self.rank, self.world_size)
        queries = tokenize(self.tokenizer, shard.query_texts + shard.dual_query_texts,
                           self.query_prompt, padding=True, truncation=True,
                           max_length=self.max_query_length, return_tensors="pt")
        texts = self.corpus.texts(shard.doc_indices)
        if self.passages is not None:
            texts = self.passages.passage(texts, shard.doc_passages or [0] * len(texts))
        docs = tokenize(self.tokenizer, texts, self.document_prompt, padding=True, truncation=True,
                        max_length=self.max_doc_length, return_tensors="pt")
        return StepInputs(shard, queries["input_ids"], queries["attention_mask"],
                          docs["input_ids"], docs["attention_mask"],
                          prepare_ms=(time.perf_counter() - started) * 1000)

    def submit(self, planned: PlannedBatch) -> Future[StepInputs]:
        """Start preparing ``planned``; its inputs come from :meth:`result`."""
        if self._executor is None:
            future: Future[StepInputs] = Future()
            try:
                future.set_result(self.prepare(planned))
            except Exception as error:  # raised again by result(), in the loop
                future.set_exception(error)
        else:
            future = self._executor.submit(self.prepare, planned)
        self._unread.add(future)
        return future

    def result(self, future: Future[StepInputs]) -> StepInputs:
        """The prepared inputs (blocking until ready); the worker's exception is raised here."""
        started = time.perf_counter()
        self._unread.discard(future)
        inputs = future.result()
        inputs.wait_ms = (time.perf_counter() - started) * 1000
        return inputs

    def close(self) -> None:
        """Stop the worker (after the batch it is on). A batch prepared for a step that never
        ran (the run stopped first) is dropped; its failure, if any, is logged."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for future in self._unread:
            if not future.cancelled() and future.exception() is not None:
                log.error("preparing a batch that was never trained failed: %r",
                          future.exception())
        self._unread.clear()
