"""Data-parallel training (src/ance_train/trainer/distributed.py, step.py, grad_cache.py).

Two ranks are real processes (``torch.multiprocessing.spawn``) joined over gloo on
127.0.0.1 through the torchrun environment variables, each training a tiny BERT under DDP on
its slice of the global batch; the reference is the same code in this process at world size 1.
Dropout is 0 in these comparisons: the two sides encode different row sets per forward, so
their dropout masks could not coincide (the RNG replay of GradCache is tested with dropout in
tests/test_grad_cache.py).

Tolerances: the two sides compute the same float32 sums in a different order (each rank sums
its own queries' contributions to a document's gradient, the gather's backward then adds the
ranks; GradCache encodes and back-propagates chunk by chunk; padding differs with the slice),
so results agree to float32 rounding, not bit for bit. Measured when this was written:

* losses differ by ≤ 6e-7 on losses of ~2 (relative 3e-7): asserted at relative 1e-5;
* a gradient tensor differs by ≤ 1.1e-5 of its largest entry (LayerNorm biases: sums of
  hundreds of terms that largely cancel): asserted at 1e-4 of its largest entry, with a floor
  of 1e-7 × the model's largest gradient for the attention key biases, whose gradient is zero
  in exact arithmetic (softmax over keys ignores a shared shift) and ~1e-11 of noise here;
* weights after 5 AdamW steps (lr 1e-3, weights up to ~1) differ by ≤ 6.2e-7: asserted at
  1e-5 absolute. Adam normalises each update to ~lr, so any systematic error — a wrong
  positive column, a missing cross-rank gradient — moves weights by ~1e-3, a hundred times the
  tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ance_train.launcher.ports import free_port
from ance_train.trainer.distributed import DistributedContext, reorder, shard_batch
from ance_train.trainer.loss import contrastive_nll

from ance_train_dev import distributed_world
from ance_train_dev.distributed_world import CHUNKS, STEPS, World, make_model

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return distributed_world.scenarios(model_dir, DistributedContext())
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(distributed_world.rank_main,
             args=(WORLD_SIZE, free_port(), str(model_dir), str(out)),
             nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]


def _close(left: torch.Tensor, right: torch.Tensor, floor: float, rel: float = 1e-4) -> bool:
    """Within ``rel`` of the tensor's largest entry, or within ``floor`` (set relative to the
    largest gradient of the model) for gradients that are zero in exact arithmetic — a key
    bias cannot change a softmax over keys: its gradient is rounding noise of ~1e-12."""
    tolerance = max(rel * float(right.abs().max()), floor)
    return float((left - right).abs().max()) <= tolerance


# --- the global batch, sliced (no processes) --------------------------------------------

def _one_hot_docs(doc_indices: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(doc_indices), 200).float()


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("dance", [False, True])
def test_every_positive_column_points_at_its_own_positive(world_size: int, dance: bool) -> None:
    """Gather the ranks' document rows as the all-gather would (rank order), reorder them:
    column ``positive_column[i]`` must hold query i's own positive, the whole matrix must be
    the global batch's, and the slices' masks must be the global batch's rows."""
    world = World()
    builder = world.batches(16)
    for _ in range(4):
        batch = world.build(builder, dance)
        shards = [shard_batch(batch, r, world_size) for r in range(world_size)]
        assert [s.doc_counts for s in shards] == [shards[0].doc_counts] * world_size
        gathered = torch.cat([_one_hot_docs(s.doc_indices) for s in shards])
        columns = reorder(gathered, shards[0].doc_order).argmax(dim=1).tolist()
        assert columns == batch.doc_indices
        queries = [t for s in shards for t in s.query_texts + s.dual_query_texts]
        ordered = [queries[i] for i in (range(len(queries)) if shards[0].query_order is None
                                        else shards[0].query_order.tolist())]
        assert ordered == batch.query_texts + batch.dual_query_texts
        for shard in shards:
            for local, row in enumerate(shard.rows):
                own_positive = batch.doc_indices[row]  # the batch puts query i's at column i
                assert world.dataset.positives(batch.query_ids[row]) == [own_positive]
                assert columns[int(shard.positive_column[local])] == own_positive
            assert torch.equal(shard.allowed, batch.allowed[shard.rows.start:shard.rows.stop])
        assert sum(s.size for s in shards) == len(batch.query_texts)


def test_shifted_offsets_change_the_loss() -> None:
    """The bug of sentence-transformers #3442: gathered rows taken in rank order, as if they
    were the global columns. A later rank's queries then score another document in their
    positive column — a hard negative of rank 0 — and the loss moves measurably."""
    world = World()
    batch = world.build(world.batches(16), dance=False)
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    torch.manual_seed(0)
    embedding = torch.randn(200, 8)
    gathered = torch.cat([embedding[s.doc_indices] for s in shards])
    queries = embedding[[batch.doc_indices[i] for i in range(16)]] + 0.1 * torch.randn(16, 8)

    def loss(docs: torch.Tensor) -> float:
        return sum(float(contrastive_nll(queries[s.rows.start:s.rows.stop] @ docs.T,
                                         s.positive_column, s.allowed, reduction="sum"))
                   for s in shards) / 16

    right = loss(reorder(gathered, shards[0].doc_order))
    global_loss = float(contrastive_nll(queries @ embedding[batch.doc_indices].T,
                                        batch.positive_column, batch.allowed))
    assert right == pytest.approx(global_loss, rel=1e-6)
    # Rank order taken as column order: rank 1's queries (rows 8-15) find, in their positive
    # columns 8-15, rank 0's hard negatives instead of their own positives.
    # (A rank-0 negative may happen to be that query's positive too: count, don't insist.)
    naive_columns = shards[0].doc_indices + shards[1].doc_indices
    assert len(shards[0].doc_indices) > 16  # 8 positives and their hard negatives
    found = [naive_columns[int(batch.positive_column[row])] for row in range(8, 16)]
    assert found == shards[0].doc_indices[8:16]
    assert sum(doc != batch.doc_indices[row] for row, doc in zip(range(8, 16), found,
                                                                strict=True)) >= 6
    assert abs(loss(gathered) - right) > 0.1


def test_batch_must_give_every_rank_a_query() -> None:
    world = World()
    batch = world.build(world.batches(3), dance=False)
    with pytest.raises(ValueError, match="at least one query"):
        shard_batch(batch, 0, 4)


# --- two ranks against one process ------------------------------------------------------

@pytest.mark.parametrize("dance", [False, True])
def test_two_ranks_train_like_one_process(reference: dict, ranks: list[dict],
                                          dance: bool) -> None:
    """2 ranks × global batch 16 = 1 process × batch 16: per-step losses and the weights after
    5 steps (hard negatives, in-batch negatives across ranks, and DANCE's dual loss)."""
    key = f"train/dance={dance}"
    one, two = reference[key], ranks[0][key]
    assert len(two["losses"]) == STEPS
    for (loss, dual), (ref_loss, ref_dual) in zip(two["losses"], one["losses"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert (dual is None) == (ref_dual is None) == (not dance)
        if dance:
            assert dual == pytest.approx(ref_dual, rel=1e-5)
    assert one["losses"][0] != one["losses"][-1]  # it trains
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=1e-5, msg=name)
    # and the ranks agree with each other exactly: the same all-reduced update everywhere
    assert ranks[1][key]["losses"] == two["losses"]
    for name, weight in two["weights"].items():
        assert torch.equal(ranks[1][key]["weights"][name], weight), name


@pytest.mark.parametrize("dance", [False, True])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_gradients_equal_the_plain_step(reference: dict, ranks: list[dict], dance: bool,
                                        chunk: int | None) -> None:
    """Loss and every parameter's gradient of one step, GradCache at chunk 1, 3 and more than
    the batch, against the plain step — in one process and on two ranks (whose all-reduced
    gradients must also be the one-process gradients). This also pins the loss scale, which
    the weights test cannot: AdamW's update is invariant to a constant factor on the gradient."""
    plain = reference[f"grad/dance={dance}/chunk=None"]
    floor = 1e-7 * max(float(g.abs().max()) for g in plain["grads"].values())
    for results in (reference, ranks[0], ranks[1]):
        got = results[f"grad/dance={dance}/chunk={chunk}"]
        assert got["loss"][0] == pytest.approx(plain["loss"][0], rel=1e-5)
        if dance:
            assert got["loss"][1] == pytest.approx(plain["loss"][1], rel=1e-5)
        assert got["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            assert _close(got["grads"][name], grad, floor), (name, chunk, dance)
    assert any(float(g.abs().max()) > 0 for g in plain["grads"].values())


def test_one_gradient_allreduce_per_step_with_grad_cache(ranks: list[dict]) -> None:
    """A DDP communication hook counts bucket all-reduces: a GradCache step (8 chunks of one
    query, 20-odd of one document) costs what a plain step does; without ``no_sync`` every
    chunk's backward would all-reduce (sentence-transformers #4027)."""
    counts = ranks[0]["allreduces"]
    buckets = counts["plain"][-1]
    assert buckets >= 1
    assert counts["grad_cache"] == [buckets, buckets]
    assert counts["without_no_sync"][0] > 10 * buckets


def test_context_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's variables: none (or WORLD_SIZE 1) is one process; a world without its
    rendezvous address is an error that says how to start the trainer."""
    from ance_train.trainer.distributed import init_from_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_from_env() == DistributedContext()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR, MASTER_PORT.*torch\.distributed\.run"):
        init_from_env()


def test_trainer_needs_torchrun_for_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from ance_train.trainer.composition import distributed_context

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed_context(1) == DistributedContext()
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is 1: start the trainer with python -m "
                                           r"torch\.distributed\.run --nproc-per-node 2"):
        distributed_context(2)
