"""What a checkpoint holds besides the weights, so that a restarted trainer continues exactly.

``training_state.safetensors`` holds the tensors (AdamW moments, torch / CUDA RNG states),
``training_state.json`` the rest: step, optimizer hyper-parameters, LR scheduler, Python and
NumPy RNG states, the batch sampler's position, the negatives tables in use and the summary
records so far, and the batch built ahead for the next step (:mod:`.prefetch`). Neither file
is a pickle (see :mod:`ance_train.trainer.tensor_state`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ance_train.protocol import keys
from ance_train.trainer.tensor_state import StateFormatError, load_state, save_state

STATE_JSON = keys.TRAINING_STATE_JSON
STATE_TENSORS = keys.TRAINING_STATE_TENSORS
FORMAT_VERSION = 1


@dataclass
class NegativesInUse:
    """The tables the trainer holds: checkpoint steps of the ANN / DANCE tables, BM25 or not,
    and the table the last step drew from (for the swap records)."""

    ann: int | None = None
    dual: int | None = None
    bm25: bool = False
    in_use: int | None = None


@dataclass
class TrainingState:
    step: int
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    batches: dict[str, Any]
    negatives: NegativesInUse = field(default_factory=NegativesInUse)
    record: dict[str, Any] = field(default_factory=dict)
    # The batch of step ``step + 1``, built before step ``step`` trained (one-batch lookahead,
    # :mod:`.prefetch`): ``batches`` is the sampler's position after it. None: none was built
    # (checkpoint 0, the last step, or a checkpoint written before the lookahead existed).
    lookahead: dict[str, Any] | None = None
    # The trained weights θ where the checkpoint's model files hold a blend of them with the
    # starting weights (training.wise_ft_alpha < 1, :mod:`.interpolation`); None: the model
    # files are the trained weights.
    trained_weights: dict[str, torch.Tensor] | None = None

    def save(self, directory: Path) -> None:
        """Write the two state files into a checkpoint directory."""
        body = {"version": FORMAT_VERSION, "step": self.step, "optimizer": self.optimizer,
                "scheduler": self.scheduler, "rng": self.rng, "batches": self.batches,
                "negatives": vars(self.negatives), "record": self.record,
                "lookahead": self.lookahead, "trained_weights": self.trained_weights}
        save_state(body, directory / STATE_JSON, directory / STATE_TENSORS)

    @classmethod
    def load(cls, directory: Path) -> TrainingState:
        """Read the state files of a checkpoint directory (StateFormatError if unusable)."""
        if not (directory / STATE_JSON).is_file():
            raise StateFormatError(f"checkpoint {directory} has no {STATE_JSON}: cannot resume")
        body = load_state(directory / STATE_JSON, directory / STATE_TENSORS)
        if not isinstance(body, dict) or body.get("version") != FORMAT_VERSION:
            raise StateFormatError(f"{directory / STATE_JSON}: unknown training state format")
        return cls(step=int(body["step"]), optimizer=body["optimizer"],
                   scheduler=body["scheduler"], rng=body["rng"], batches=body["batches"],
                   negatives=NegativesInUse(**body["negatives"]), record=body["record"],
                   lookahead=body.get("lookahead"),
                   trained_weights=body.get("trained_weights"))


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step draws from (dropout, sampling, shuffles)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
