"""The retention actor: reads what the run announced and deletes what the rules of
:mod:`ance_train.protocol.retention` let go (``store.keep_refreshes`` / ``keep_checkpoints``).

The indexer sweeps per-refresh objects after each refresh, the trainer checkpoints after each
checkpoint, the embedded launcher both once its services have stopped; each deletes only the
kind of object it alone knows nobody reads any more (the rules' docstring says why).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from ance_train.protocol import keys
from ance_train.protocol.events import (
    EvalCompleted,
    Event,
    NegativesReady,
    RunFinished,
    TablesInUse,
)
from ance_train.protocol.retention import (
    UNKNOWN,
    TrainerFloor,
    checkpoints_to_delete,
    refresh_keys_to_delete,
)

if TYPE_CHECKING:
    from ance_train.infra.bus import EventBus
    from ance_train.infra.store import ObjectStore

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)


@dataclass
class Sweep:
    """What one pass deleted (for the log, the tests and the store size)."""

    keys: list[str]
    bytes: int

    def __bool__(self) -> bool:
        return bool(self.keys)


def delete_refreshes(store: ObjectStore, built: Iterable[int], keep: int | None,
                     trainer_needs_from: TrainerFloor) -> Sweep:
    """Delete the superseded per-refresh objects of ``store``."""
    if keep is None or trainer_needs_from is UNKNOWN:
        return Sweep([], 0)
    sizes: dict[str, int] = {}
    for family in keys.REFRESH_FAMILIES:
        sizes.update(store.sizes(family))
    doomed = refresh_keys_to_delete(sizes, built, keep, trainer_needs_from)
    for key in doomed:
        store.delete(key)
    if doomed:
        # The cast: refresh_keys_to_delete returns per-refresh keys only (their step is set).
        steps = cast("set[int]", {keys.refresh_step(k) for k in doomed})
        log.info("retention: deleted %d objects of refreshes %s (%d bytes)", len(doomed),
                 sorted(steps), sum(sizes[k] for k in doomed))
    return Sweep(doomed, sum(sizes[k] for k in doomed))


def delete_checkpoints(store: ObjectStore, keep: int | None,
                       evaluated: Mapping[int, Mapping[str, Mapping[str, float]]]) -> Sweep:
    """Delete the superseded checkpoints of ``store``: each one's MANIFEST.json first, then
    its WEIGHTS.json (:mod:`ance_train.protocol.checkpoints`), then its files."""
    if keep is None:
        return Sweep([], 0)
    sizes = store.sizes(keys.CHECKPOINTS)
    steps = checkpoints_to_delete(sizes, keep, evaluated)
    doomed: list[str] = []
    for step in steps:
        prefix = keys.checkpoint(step) + "/"
        manifests = [keys.checkpoint_manifest(step), keys.checkpoint_weights_manifest(step)]
        rest = sorted(k for k in sizes if k.startswith(prefix) and k not in manifests)
        for key in [*manifests, *rest]:
            store.delete(key)
        doomed += [k for k in manifests if k in sizes] + rest
    if doomed:
        log.info("retention: deleted checkpoints %s (%d bytes)", steps,
                 sum(sizes.get(k, 0) for k in doomed))
    return Sweep(doomed, sum(sizes.get(k, 0) for k in doomed))


class RunRetention:
    """The rules applied to one run: what they need is read from the run's streams,
    incrementally (a cursor per stream), so a sweep costs one listing of the run's
    per-refresh (or checkpoint) keys plus the events since the last sweep.

    The indexer calls :meth:`sweep_refreshes` after each refresh, the trainer
    :meth:`sweep_checkpoints` after each checkpoint, the embedded launcher both once its
    services have stopped.
    """

    def __init__(self, bus: EventBus, store: ObjectStore, keep_refreshes: int | None,
                 keep_checkpoints: int | None) -> None:
        self.bus = bus
        self.store = store
        self.keep_refreshes = keep_refreshes
        self.keep_checkpoints = keep_checkpoints
        self.built: set[int] = set()
        self.evaluated: dict[int, dict[str, dict[str, float]]] = {}
        self.trainer_needs_from: TrainerFloor = UNKNOWN
        self.finished = False
        self._cursors: dict[type, str] = {}

    def _read(self, event_type: type[E]) -> list[E]:
        out: list[E] = []
        while True:
            batch = self.bus.read_all(event_type, after=self._cursors.get(event_type, "0"),
                                      count=500)
            if not batch:
                return out
            self._cursors[event_type] = batch[-1].entry_id
            out += [received.event for received in batch]

    def refresh(self) -> None:
        """Take in the events published since the last call."""
        for ready in self._read(NegativesReady):
            if ready.step is not None:
                self.built.add(ready.step)
        for done in self._read(EvalCompleted):
            self.built.add(done.step)
            self.evaluated[done.step] = done.metrics
        for in_use in self._read(TablesInUse):
            self.trainer_needs_from = in_use.needed_from
        if self._read(RunFinished):
            self.finished = True
        if self.finished:
            self.trainer_needs_from = None  # a finished trainer reads nothing more

    def sweep_refreshes(self) -> Sweep:
        if self.keep_refreshes is None:
            return Sweep([], 0)
        self.refresh()
        return delete_refreshes(self.store, self.built, self.keep_refreshes,
                                self.trainer_needs_from)

    def sweep_checkpoints(self) -> Sweep:
        if self.keep_checkpoints is None:
            return Sweep([], 0)
        self.refresh()
        return delete_checkpoints(self.store, self.keep_checkpoints, self.evaluated)
