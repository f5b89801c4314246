"""Which refresh wins when checkpoints arrive faster than refreshes: decided here only.

If every newer checkpoint cancelled the refresh in progress, a trainer that checkpoints
faster than a refresh takes would never receive negatives. So (as ANCE's Inferencer does,
§4 of "Approximate Nearest Neighbor Negative Contrastive Learning for Dense Text Retrieval",
ICLR 2021, arXiv:2007.00808: it "takes the latest checkpoint" when it starts a refresh):

* an inferencer encodes an item only if its checkpoint is the latest published one or the
  refresh already under way (:func:`worth_encoding`); items of checkpoints overtaken before
  their refresh started are skipped;
* the indexer builds checkpoint 0 first, then always the newest complete checkpoint
  (:func:`next_to_build`), and abandons a build when a newer checkpoint completes
  (:func:`superseded`).

Checkpoint 0, the untrained encoder, is never superseded: every run's zero-shot row and the
first ANN negatives come from it.

The rule is here; the shared state it reads (the latest published checkpoint, the refresh
under way and the script that raises it atomically) is behind
:class:`ance_train.infra.bus.EventBus` (``latest_checkpoint``, ``start_encoding``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ance_train.protocol.work import ZERO_SHOT_STEP


class Superseded(Exception):
    """Raised by the indexer to abandon the build of a checkpoint that a newer one overtook."""


def worth_encoding(step: int, latest: int, under_way: int) -> bool:
    """Should an inferencer encode an item of checkpoint ``step``, given the latest published
    checkpoint and the refresh under way (the highest step any replica started)?"""
    return step in (latest, under_way, ZERO_SHOT_STEP)


def next_to_build(complete: Mapping[int, bool], last_built: int | None) -> int | None:
    """The checkpoint the indexer builds next, among planned ones (``step -> complete?``):
    checkpoint 0 while it is not built (waiting for it if incomplete), else the newest
    complete one newer than ``last_built``."""
    if ZERO_SHOT_STEP in complete and (last_built is None or last_built < ZERO_SHOT_STEP):
        return ZERO_SHOT_STEP if complete[ZERO_SHOT_STEP] else None
    ready = [step for step, done in complete.items()
             if done and (last_built is None or step > last_built)]
    return max(ready, default=None)


def superseded(building: int, next_step: int | None) -> bool:
    """Is the build of ``building`` overtaken, when ``next_step`` is what would be built next?"""
    return building != ZERO_SHOT_STEP and next_step is not None and next_step > building
