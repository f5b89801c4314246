"""What the store keeps and what it may delete (``store.keep_refreshes`` / ``keep_checkpoints``).

A run writes, per refresh, embedding shards and negatives tables (and whatever else lives
under a family of :data:`ance_train.protocol.keys.REFRESH_FAMILIES`), and a checkpoint per
``refresh_every`` steps; without retention its store grows linearly with the run. Deleting
is safe only when no reader can still want the object, and each object has one service
that knows that, so each service deletes only its own kind:

* **Per-refresh objects — the indexer**, after each refresh it builds (and the embedded
  launcher once more when every service has stopped). Refresh ``s`` goes when

  1. ``s`` is not one of the newest ``keep_refreshes`` built refreshes and is older than
     the newest (so a newer ``negatives.ready`` / ``eval.completed`` is out and no build
     needs ``s``: the indexer builds only checkpoints newer than the last one it built; an
     ``s`` that was encoded but superseded before its build goes too), and
  2. the trainer has announced ``negatives.in_use`` with ``needed_from > s`` (or
     ``needed_from`` None: it reads no refresh table), or ``run.finished``. Until the first
     announcement nothing goes. ``needed_from`` covers the table the loop samples from
     *and* the tables of the trainer's newest complete checkpoint, which a restarted trainer
     reloads — so a trainer still on table k keeps k, and every newer one, however many
     refreshes are ready.

  The key families are matched by prefix and step (:func:`~ance_train.protocol.keys.
  refresh_step`), not by listing known file names, so per-refresh objects added later are
  covered by construction. ``negatives/bm25.npz`` and ``eval/<k>.json`` are not per-refresh
  objects: they are kept.

* **Checkpoints — the trainer**, after each checkpoint upload (and the launcher at the end).
  A complete checkpoint goes unless it is one of the newest ``keep_checkpoints`` complete
  ones (the newest is what a restarted trainer resumes from), the best by dev nDCG@10 (what
  ``ance-train export --checkpoint best`` picks, except with a dev split under 50 queries:
  there it picks the latest within the best's noise (:mod:`.selection`) among the checkpoints
  still stored), the newest evaluated one (the indexer's
  Search encodes queries with it), or newer than the newest evaluated one (its refresh may
  be in flight: inferencers load it). A checkpoint with ``WEIGHTS.json`` alone
  (:mod:`ance_train.protocol.checkpoints`) is not a resume point, so it never counts among
  the newest ``keep_checkpoints``; it may go, under the same rules, only once a newer
  checkpoint is complete (the trainer uploads checkpoints one at a time in step order, so
  its training state is then no longer on its way: its trainer died). A checkpoint's
  ``MANIFEST.json`` is deleted first, then its ``WEIGHTS.json``, so nobody takes a
  half-deleted checkpoint for a complete or a loadable one.

``None`` keeps everything (nothing is even listed).

The rules are here, as pure functions of what is stored and what was announced; the actor
that reads the announcements and deletes (:class:`~ance_train.infra.retention.RunRetention`)
is in ``infra/retention.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ance_train.protocol import keys
from ance_train.protocol.checkpoints import Stored, stored_checkpoints
from ance_train.protocol.selection import DevPoint, best_step

# How "best" is chosen, here and by `ance-train export --checkpoint best`: never on test.
BEST_SPLIT = "dev"
BEST_MEASURE = "ndcg@10"


class _Unknown:
    """The trainer has not announced ``negatives.in_use`` yet: delete no refresh."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()
TrainerFloor = int | None | _Unknown


def refresh_keys_to_delete(stored: Iterable[str], built: Iterable[int], keep: int | None,
                           trainer_needs_from: TrainerFloor) -> list[str]:
    """The per-refresh keys among ``stored`` that may go (rules in the module docstring).

    ``built``: the refreshes the indexer built (``negatives.ready`` / ``eval.completed``);
    ``trainer_needs_from``: the last ``negatives.in_use``'s ``needed_from``, None after
    ``run.finished``, :data:`UNKNOWN` before any announcement.
    """
    if keep is None or isinstance(trainer_needs_from, _Unknown):
        return []
    newest = sorted(set(built))[-keep:]
    if not newest:
        return []
    below = newest[-1] if trainer_needs_from is None else min(newest[-1], trainer_needs_from)
    return sorted(key for key in stored
                  if (step := keys.refresh_step(key)) is not None and step < below
                  and step not in newest)


def best_checkpoint(metrics: Mapping[int, Mapping[str, Mapping[str, float]]]) -> int | None:
    """The step with the highest dev nDCG@10, by :func:`.selection.best_step` (so a tie keeps
    the checkpoint ``export --checkpoint best`` picks), None without any."""
    points = [DevPoint(step, values[BEST_SPLIT][BEST_MEASURE])
              for step, values in metrics.items() if BEST_MEASURE in values.get(BEST_SPLIT, {})]
    return best_step(points) if points else None


def checkpoints_to_delete(stored: Iterable[str], keep: int | None,
                          evaluated: Mapping[int, Mapping[str, Mapping[str, float]]]
                          ) -> list[int]:
    """The checkpoints that may go (rules in the module docstring), ascending.

    ``stored``: the keys under ``checkpoints/``; ``evaluated``: the metrics of every
    ``eval.completed`` by step (split → measure → value).
    """
    if keep is None:
        return []
    stages = stored_checkpoints(stored)
    complete = sorted(step for step, stage in stages.items() if stage is Stored.COMPLETE)
    protected = set(complete[-keep:])
    if not evaluated:
        return []  # every checkpoint's refresh may still be in flight
    newest_evaluated = max(evaluated)
    protected.add(newest_evaluated)
    best = best_checkpoint(evaluated)
    if best is not None:
        protected.add(best)
    # WEIGHTS.json alone: its state may still be uploading unless a newer one is complete.
    settled = [step for step in stages
               if stages[step] is Stored.COMPLETE or (complete and step < complete[-1])]
    return sorted(step for step in settled
                  if step < newest_evaluated and step not in protected)
