"""Read back what a kept run (``bench/quality.py --runs-dir``) stored for one checkpoint.

The indexer's inputs at a refresh are the corpus and query embedding shards under
``<run>/store/<run>/embeddings/<step>/``; the benchmarks that analyse a run after the fact
(``significance.py``, ``negative_hardness.py``) rebuild from those, never from a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ance_train.config import IndexConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.evaluation import evaluate
from ance_train.index.ann import AnnIndex
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.work import query_order


def find_run_dir(run_id: str, roots: list[Path]) -> Path:
    """``<root>/<run_id>/store/<run_id>`` under the first root that holds it."""
    for root in roots:
        if (root / run_id / "store" / run_id).is_dir():
            return root / run_id / "store" / run_id
    raise SystemExit(f"run {run_id}: no {run_id}/store/{run_id} under any of "
                     f"{[str(r) for r in roots]}; pass the --runs-dir the report was run with")


@dataclass
class StoredCheckpoint:
    dataset: DatasetIndex
    index: AnnIndex           # exact (flat) index over the whole corpus
    queries: np.ndarray       # [all queries, dim] in ``query_order`` rows
    query_row: dict[str, int]

    def query_vectors(self, query_ids: list[str]) -> np.ndarray:
        return self.queries[[self.query_row[q] for q in query_ids]]


def load_checkpoint(store_dir: Path, step: int, similarity: str = "dot") -> StoredCheckpoint:
    """The embeddings of checkpoint ``step`` in a flat ``AnnIndex`` of ``similarity``: the
    one the run's evaluator used. The indexer's is ``dot`` (``indexer/build.py``: the stored
    vectors as they are; a cosine model stored unit vectors). Normalising those a second time
    moves scores in their last bits, enough to swap two near-tied documents of a top 10."""
    dataset = DatasetIndex.from_json((store_dir / keys.DATASET_INDEX).read_text())
    shards = store_dir / keys.embeddings(step)
    if not shards.is_dir():
        raise SystemExit(f"{shards}: the embeddings of checkpoint {step} are not there")
    index: AnnIndex | None = None
    for path in sorted(shards.glob("corpus-*.npz")):
        ids, vectors = unpack_embeddings(path.read_bytes())
        if index is None:
            index = AnnIndex(vectors.shape[1], IndexConfig(type="flat", device="cpu"),
                             similarity, expected_size=dataset.num_docs)
        index.add(ids, vectors)
    if index is None:
        raise SystemExit(f"{shards}: no corpus shards")
    index.finalize()
    query_row = {q: i for i, q in enumerate(query_order(dataset))}
    queries = np.zeros((len(query_row), index.dim), dtype=np.float32)
    for path in sorted(shards.glob("queries-*.npz")):
        ids, vectors = unpack_embeddings(path.read_bytes())
        if ids.dtype.kind in "iu":  # runs before query shards carried query ids: rows
            queries[ids] = vectors
        else:
            queries[[query_row[str(q)] for q in ids]] = vectors
    return StoredCheckpoint(dataset, index, queries, query_row)


def evaluate_flat(docs: np.ndarray, queries: np.ndarray, query_row: Mapping[str, int],
                  splits: Mapping[str, Mapping[str, Mapping[int, int]]],
                  index_cfg: IndexConfig, similarity: str) -> dict[str, dict[str, float]]:
    """What the indexer's evaluation does, split by split (``index_cfg.eval_depth`` hits,
    ``ance_train.evaluation.evaluate``), over an exact (flat) index of ``docs`` whose rows are
    the document indices; ``queries[query_row[q]]`` is query ``q``'s vector."""
    flat = IndexConfig(**{**index_cfg.model_dump(), "type": "flat", "device": "cpu"})
    index = AnnIndex(docs.shape[1], flat, similarity, expected_size=len(docs))
    index.add(np.arange(len(docs), dtype=np.int64), docs)
    index.finalize()
    metrics = {}
    for split, qrels in splits.items():
        qids = sorted(qrels)
        ranked, scores = index.search(queries[[query_row[q] for q in qids]], flat.eval_depth,
                                      flat.search_batch_size)
        run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
               for q, r, sc in zip(qids, ranked, scores, strict=True)}
        metrics[split] = evaluate(run, {q: {str(d): rel for d, rel in rels.items()}
                                        for q, rels in qrels.items()})
    return metrics
