"""Early stopping on dev (``training.early_stopping``): end training when the dev metric has
stopped improving.

The state is derived, never kept: :func:`decide` reads the dev values of the evaluated
checkpoints in step order from the eval reports in the run's store (``eval/<k>.json``, which
retention never deletes), so a restarted trainer reaches the same decision from the same
reports (exact resume). The first evaluated checkpoint (step 0, zero-shot) sets the best
value; each later one either beats the best by more than ``min_delta`` (the new best, the
count back to 0) or counts as non-improving; ``patience`` non-improving ones in a row stop
the run. Patience is thus counted in refreshes (evaluated checkpoints), not steps.

The trainer checks the decision before each step (:meth:`EarlyStopping.decision`, a cached
value a thread of its own updates whenever an ``eval.completed`` arrives, so a step never
waits on Redis or the store). On a stop it saves a final checkpoint at the step it reached
(unless that step has one), publishes ``run.finished`` with that step, and records
``stopped_early: {at_step, best_step, best_value}`` in its summary: the launcher (and
retention) learn the end from ``run.finished`` as after the last step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ance_train.config import EarlyStoppingConfig
from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus
from ance_train.infra.store import ObjectStore, StorageError
from ance_train.protocol import keys
from ance_train.protocol.events import EvalCompleted

log = logging.getLogger(__name__)
SPLIT = "dev"  # the split early stopping (and checkpoint selection) watches


@dataclass(frozen=True)
class StopDecision:
    """What the evaluations so far say (:func:`decide`)."""

    stop: bool
    best_step: int | None = None
    best_value: float | None = None
    non_improving: int = 0  # evaluated checkpoints since the best (at the stop: patience)
    evaluated: int = 0      # evaluations read (up to the one that stopped the run)
    decided_at: int | None = None  # the evaluated checkpoint that made it stop

    def to_dict(self) -> dict:
        return asdict(self)


def decide(evaluations: Iterable[tuple[int, float]], settings: EarlyStoppingConfig
           ) -> StopDecision:
    """The decision after ``evaluations`` ((checkpoint step, dev value), any order):
    stop once ``settings.patience`` consecutive evaluated checkpoints fail to beat the best
    value so far by more than ``settings.min_delta``; the evaluations after the one that
    stopped it are ignored (so the decision never changes once made)."""
    best_step: int | None = None
    best_value: float | None = None
    bad = count = 0
    for step, value in sorted(evaluations):
        count += 1
        if best_value is None or value > best_value + settings.min_delta:
            best_step, best_value, bad = step, value, 0
            continue
        bad += 1
        if bad >= settings.patience:
            return StopDecision(True, best_step, best_value, bad, count, decided_at=step)
    return StopDecision(False, best_step, best_value, bad, count)


def stored_evaluations(store: ObjectStore, metric: str, up_to: int | None = None,
                       split: str = SPLIT) -> list[tuple[int, float]]:
    """(step, ``split`` ``metric``) of every eval report in ``store`` (checkpoints up to
    ``up_to`` when given), in step order; a report without the split is skipped."""
    found = []
    for key in store.list(keys.EVAL_REPORTS + "/"):
        step = keys.eval_report_step(key)
        if step is None or (up_to is not None and step > up_to):
            continue
        value = store.get_json(key).get("metrics", {}).get(split, {}).get(metric)
        if value is not None:
            found.append((step, float(value)))
    return sorted(found)


class EarlyStopping:
    """The trainer's view of :func:`decide`: computed from the store at start
    (:meth:`refresh`), then again on a thread of its own at each ``eval.completed``."""

    def __init__(self, settings: EarlyStoppingConfig, store: ObjectStore, bus: EventBus,
                 stop: threading.Event) -> None:
        self.settings = settings
        self.store, self.bus, self.stop = store, bus, stop
        self._decision = StopDecision(False)
        self._thread: threading.Thread | None = None

    @property
    def decision(self) -> StopDecision:
        return self._decision

    def refresh(self, up_to: int | None = None) -> StopDecision:
        """Decide again from the eval reports in the store (up to checkpoint ``up_to``)."""
        decision = decide(stored_evaluations(self.store, self.settings.metric, up_to),
                          self.settings)
        if decision.stop and not self._decision.stop:
            log.info("early stopping: %d evaluated checkpoints in a row (the last %d) did not "
                     "beat dev %s %.4f of checkpoint %d by more than %g", decision.non_improving,
                     decision.decided_at, self.settings.metric, decision.best_value,
                     decision.best_step, self.settings.min_delta)
        if not self._decision.stop:  # once made, the decision stays
            self._decision = decision
        return self._decision

    def start(self, up_to: int) -> EarlyStopping:
        """Decide from the reports of the checkpoints up to ``up_to`` (the step the trainer
        starts or resumes at: a trainer restarted after it stopped early stops again at
        once), then follow ``eval.completed``."""
        cursor = self.bus.last_entry_id(EvalCompleted)  # before reading: nothing is missed
        self.refresh(up_to)
        self._thread = threading.Thread(target=self._listen, args=(cursor,),
                                        name="early-stopping", daemon=True)
        self._thread.start()
        return self

    def _listen(self, cursor: str) -> None:
        while not self.stop.is_set() and not self._decision.stop:
            try:
                arrived = self.bus.read_all(EvalCompleted, after=cursor, block_ms=1000)
                if arrived:
                    cursor = arrived[-1].entry_id
                    self.refresh()
            except (*REDIS_UNAVAILABLE, StorageError) as error:
                log.warning("early stopping: reading the evaluations failed: %s", error)
                self.stop.wait(1.0)
