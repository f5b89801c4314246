"""GradCache in one process (src/ance_train/trainer/grad_cache.py): the dropout RNG replay,
mixed precision, and the configuration. The comparisons across chunk sizes and ranks at
dropout 0 are in tests/test_distributed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ance_train.config import TrainingConfig
from ance_train.trainer import grad_cache
from ance_train.trainer.distributed import DistributedContext, shard_batch, shard_loss

from ance_train_dev.distributed_world import Learner, World, make_model


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-bert-dropout"), dropout=0.1)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


def _step(model_dir: Path, chunk: int | None, dance: bool = True, precision: str = "off",
          ) -> tuple[tuple[float, float | None], dict[str, torch.Tensor], torch.Tensor]:
    """Loss, gradients and the torch RNG state after one step from seed 7."""
    world = World()
    learner = Learner(model_dir, DistributedContext(), precision=precision)
    batch = world.build(world.batches(8), dance)
    torch.manual_seed(7)
    loss = learner.backward(world, batch, chunk)
    return loss, learner.gradients(), torch.get_rng_state()


def _largest_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest gradient difference, relative to the model's largest gradient."""
    scale = max(float(g.abs().max()) for g in want.values())
    return max(float((got[n] - g).abs().max()) for n, g in want.items()) / scale


def test_dropout_replay_whole_batch_equals_the_plain_step(dropout_model: Path) -> None:
    """With dropout on, a chunk larger than the batch re-encodes with the masks of the cache
    pass, which are those of the plain step (same RNG draws in the same order): same loss,
    same gradients, and the RNG left where the plain step leaves it."""
    plain_loss, plain_grads, plain_rng = _step(dropout_model, None)
    loss, grads, rng = _step(dropout_model, 1000)
    assert loss[0] == pytest.approx(plain_loss[0], rel=1e-6)
    assert loss[1] == pytest.approx(plain_loss[1], rel=1e-6)
    assert _largest_error(grads, plain_grads) < 1e-5
    assert torch.equal(rng, plain_rng)


def test_without_replay_the_gradients_are_wrong(dropout_model: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: re-forwarding on fresh dropout masks gives other gradients."""
    _, plain_grads, _ = _step(dropout_model, None)
    monkeypatch.setattr(grad_cache, "set_rng_state", lambda state, device: None)
    _, grads, _ = _step(dropout_model, 1000)
    assert _largest_error(grads, plain_grads) > 1e-3


def test_dropout_replay_in_chunks_is_the_gradient_of_the_cached_loss(dropout_model: Path,
                                                                    ) -> None:
    """Chunks of 3 with dropout: the gradient is exactly that of the loss of the chunk-wise
    encoded batch (chunk forwards with the graph, in the cache pass's order)."""
    loss, grads, _ = _step(dropout_model, 3)

    world = World()
    learner = Learner(dropout_model, DistributedContext())
    batch = world.build(world.batches(8), dance=True)
    shard = shard_batch(batch, 0, 1)
    tok = learner.tokenizer
    queries = tok(shard.query_texts + shard.dual_query_texts, padding=True, return_tensors="pt")
    docs = tok([world.docs[d] for d in shard.doc_indices], padding=True, return_tensors="pt")
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    encoded = {}
    for name, tokens in (("q", queries), ("d", docs)):
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        encoded[name] = torch.cat([learner.model(ids[lo:hi], mask[lo:hi])
                                   for lo, hi in grad_cache.chunks(len(ids), 3)])
    parts = shard_loss(learner.model.score, encoded["q"], encoded["d"], shard,
                       DistributedContext(), 0.5, learner.autocast)
    parts.backward.backward()
    assert loss[0] == pytest.approx(float(parts.backward.detach()), rel=1e-6)
    assert _largest_error(grads, learner.gradients()) < 1e-5


def test_grad_cache_under_bf16_autocast(plain_model: Path) -> None:
    """Mixed precision: both passes autocast to bf16 (here on the CPU), the loss in float32.
    The re-forward is the cache pass again, so GradCache is exact for its own (chunked)
    representations; against whole-batch encoding, bf16's rounding (8 bits of mantissa,
    ~4e-3 relative) of other matmul shapes shows: measured 5e-4 of the largest gradient,
    asserted at 5e-3. Dropout is 0: chunks would draw other masks."""
    plain_loss, plain_grads, _ = _step(plain_model, None, precision="bf16")
    loss, grads, _ = _step(plain_model, 3, precision="bf16")
    assert loss[0] == pytest.approx(plain_loss[0], rel=1e-3)
    assert loss[1] == pytest.approx(plain_loss[1], rel=1e-3)
    assert _largest_error(grads, plain_grads) < 5e-3
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_training_config_fields() -> None:
    assert TrainingConfig().processes == 1
    assert TrainingConfig().grad_cache_chunk is None
    assert TrainingConfig(grad_cache_chunk=0).grad_cache_chunk == 0  # 0: off, as None
    assert TrainingConfig(processes=4, batch_size=8).processes == 4
    with pytest.raises(ValueError, match="global batch"):
        TrainingConfig(processes=4, batch_size=2)
    with pytest.raises(ValueError):
        TrainingConfig(grad_cache_chunk=-1)
    with pytest.raises(ValueError):
        TrainingConfig(processes=0)
