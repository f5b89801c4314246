"""Published checkpoints interpolated towards the starting model (``training.wise_ft_alpha``).

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", arXiv 2109.01903) serves
``θ0 + α (θ − θ0)``: the starting weights moved a fraction α of the way to the fine-tuned
ones. On a few hundred training queries it is a regularisation towards the pretrained model
that costs nothing at training time (issue 33; the offline scan: ``bench/interpolation.py``).

The trainer optimises θ as always. Only what it publishes is interpolated: the checkpoint's
model files hold the blend, so the inferencers encode it, the indexer mines negatives with it
and evaluates it, and ``ance-train export`` writes it. The trained θ goes into the
checkpoint's training state (:attr:`TrainingState.trained_weights`), so a restarted trainer
goes on from θ, bit for bit; θ0 is stored once per run (``keys.START_WEIGHTS``), since a
projection head's random start is in no model directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ance_train.infra.store import ObjectStore
from ance_train.modeling.model import BiEncoder
from ance_train.protocol import keys

Weights = dict[str, torch.Tensor]


def floating_weights(model: BiEncoder) -> Weights:
    """CPU copies of the model's floating-point tensors (parameters and buffers, by
    ``state_dict`` name); integer buffers (position ids) are not interpolated."""
    return {name: tensor.detach().to("cpu", copy=True)
            for name, tensor in model.state_dict().items() if tensor.is_floating_point()}


def blend(start: Weights, trained: Weights, alpha: float) -> Weights:
    """WiSE-FT's ``θ0 + α (θ − θ0)`` for each tensor of ``trained`` (floating-point ones)."""
    return {name: start[name] + alpha * (value - start[name]) for name, value in trained.items()}


def load_weights(model: BiEncoder, weights: Weights) -> None:
    """Copy ``weights`` into the model's tensors in place (no new parameters: the optimizer
    keeps pointing at them)."""
    state = model.state_dict()
    missing = sorted(set(weights) - set(state))
    if missing:
        raise ValueError(f"weights name tensors the model lacks: {missing[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(value)


class StartInterpolation:
    """θ0 and α; :meth:`published` puts the blend in the model while a checkpoint is saved."""

    def __init__(self, start: Weights, alpha: float) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"wise_ft_alpha {alpha}: interpolation needs 0 < α < 1")
        self.start, self.alpha = start, alpha

    @classmethod
    def for_run(cls, model: BiEncoder, alpha: float, store: ObjectStore, work_dir: Path,
                resumed: bool) -> StartInterpolation | None:
        """For the rank that publishes (rank 0): None when α is 1. θ0 is ``model``'s weights
        on a fresh start, stored for a restarted trainer, and the stored ones on resume."""
        if alpha >= 1.0:
            return None
        local = work_dir / "start-weights.safetensors"
        if resumed:
            if not store.exists(keys.START_WEIGHTS):
                raise RuntimeError(
                    f"training.wise_ft_alpha is {alpha} but the run has no starting weights "
                    f"({keys.START_WEIGHTS}): it did not start with interpolation on")
            store.get_file(keys.START_WEIGHTS, local)
            return cls(load_file(str(local)), alpha)
        start = floating_weights(model)
        save_file({k: v.contiguous() for k, v in start.items()}, str(local))
        store.put_file(keys.START_WEIGHTS, local)
        return cls(start, alpha)

    @contextmanager
    def published(self, model: BiEncoder) -> Iterator[Weights]:
        """Within the block the model holds θ0 + α (θ − θ0); it yields θ (CPU copies, for the
        training state), and puts θ back exactly on the way out."""
        trained = floating_weights(model)
        load_weights(model, blend(self.start, trained, self.alpha))
        try:
            yield trained
        finally:
            load_weights(model, trained)
