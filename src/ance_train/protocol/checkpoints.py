"""What the store holds of each checkpoint, read from its manifests (keys in :mod:`.keys`).

The trainer stores a checkpoint in this order (:mod:`ance_train.trainer.checkpoints`):

1. the model's files, then ``WEIGHTS.json`` listing them — the checkpoint is
   :attr:`Stored.WEIGHTS`: its model can be loaded;
2. the latest-checkpoint marker, the shard work items, ``checkpoint.published``;
3. the training state, then ``MANIFEST.json`` listing every file — :attr:`Stored.COMPLETE`:
   a restarted trainer may resume from it.

So encoding never waits for the training state, and a checkpoint whose state never arrived
(its trainer died in between) is never resumed from. A checkpoint with neither manifest is an
upload cut short: it does not exist. A store written before ``WEIGHTS.json`` existed holds
``MANIFEST.json`` alone: complete (and loadable) all the same.

Deleting reverses the order: ``MANIFEST.json``, then ``WEIGHTS.json``, then the files
(:func:`ance_train.infra.retention.delete_checkpoints`).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

from ance_train.protocol import keys


class Stored(IntEnum):
    """How far a checkpoint's upload got (ordered: ``COMPLETE`` > ``WEIGHTS``)."""

    WEIGHTS = 1   # WEIGHTS.json: the model can be loaded; it is announced, or about to be
    COMPLETE = 2  # MANIFEST.json: the training state too; it can be resumed from


_MANIFESTS = {keys.CHECKPOINT_WEIGHTS_MANIFEST: Stored.WEIGHTS,
              keys.CHECKPOINT_MANIFEST: Stored.COMPLETE}


def stored_checkpoints(stored: Iterable[str]) -> dict[int, Stored]:
    """Every checkpoint with a manifest among the run-relative keys ``stored`` (a listing of
    ``checkpoints/``), by step."""
    found: dict[int, Stored] = {}
    for key in stored:
        parts = key.split("/")
        stage = _MANIFESTS.get(parts[-1]) if len(parts) == 3 else None
        step = keys.checkpoint_step(key)
        if stage is not None and step is not None:
            found[step] = max(stage, found.get(step, stage))
    return found


def complete_checkpoints(stored: Iterable[str]) -> list[int]:
    """Steps of the checkpoints whose MANIFEST.json (written last) is among ``stored``:
    what a trainer may resume from. Ascending."""
    return sorted(step for step, stage in stored_checkpoints(stored).items()
                  if stage is Stored.COMPLETE)


def loadable_checkpoints(stored: Iterable[str]) -> list[int]:
    """Steps of the checkpoints whose model can be loaded (either manifest is stored):
    what an inferencer encodes with and `ance-train export` exports. Ascending."""
    return sorted(stored_checkpoints(stored))
