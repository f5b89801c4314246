"""The indexer's per-checkpoint state: each pending refresh's plan, the shards received, the
partitions' lists, the refresh timeline's events, and which checkpoints are built, searched
or abandoned. ``forget(step)`` drops all of it for one checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ance_train.infra.bus import Received, entry_seconds
from ance_train.protocol.events import CheckpointPublished, PartitionSearched, ShardEncoded
from ance_train.protocol.supersession import next_to_build
from ance_train.protocol.work import ZERO_SHOT_STEP, RefreshPlan

#: The shards a process waits for before it builds a plan (its role's part of it).
Needed = Callable[[RefreshPlan], set[str]]


class RefreshTracker:
    """What one indexer process knows of the checkpoints it has not finished with.

    ``announces``: this process announces refreshes (the single indexer, or partition 0): it
    keeps plans until the refresh is announced, the shard events of the timeline and which
    partitions stored their lists.
    """

    def __init__(self, announces: bool, partitions: int = 1) -> None:
        self.announces = announces
        self.partitions = partitions
        self.plans: dict[int, RefreshPlan] = {}  # published, not yet built or abandoned
        self.received: dict[int, set[str]] = {}
        self.published_at: dict[int, float] = {}  # Redis server time of checkpoint.published
        # Redis server time of the shard.encoded that completed this process's part of a plan
        self.completed_at: dict[int, float] = {}
        # The refresh timeline (observability/timeline.py): each pending checkpoint's
        # checkpoint.published and the shard.encoded of its shards, by key.
        self.published: dict[int, CheckpointPublished] = {}
        self.shard_events: dict[int, dict[str, ShardEncoded]] = {}
        self.completed_wall: dict[int, float] = {}  # Unix time this process read it complete
        # P > 1, partition 0: checkpoint -> partition -> its partition.searched
        self.searched: dict[int, dict[int, PartitionSearched]] = {}
        self.abandoned: set[int] = set()  # checkpoints with a shard.failed item
        self.last_built: int | None = None  # the newest refresh announced
        self.last_searched: int | None = None  # P > 1: this partition's newest stored lists

    def forget(self, step: int) -> None:
        """Drop what was kept about checkpoint ``step`` while it was pending."""
        for table in (self.plans, self.received, self.published_at, self.completed_at,
                      self.published, self.shard_events, self.completed_wall, self.searched):
            table.pop(step, None)

    def forget_through(self, step: int) -> None:
        """Forget ``step`` and every older checkpoint."""
        for old in [s for s in {*self.plans, *self.shard_events, *self.searched} if s <= step]:
            self.forget(old)

    # -- markers ----------------------------------------------------------------------------
    def built(self, step: int) -> bool:
        """Was the refresh of ``step`` (or a newer one) announced?"""
        return self.last_built is not None and step <= self.last_built

    def searched_through(self, step: int) -> bool:
        """Has this process's part of ``step`` (or a newer one) been done: its lists stored
        (P > 1), or the refresh already announced?"""
        return self.built(step) or (self.last_searched is not None
                                    and step <= self.last_searched)

    def announced(self, step: int) -> None:
        """The refresh of ``step`` went out: older pending checkpoints are done with."""
        self.last_built = step
        self.forget_through(step)

    def part_searched(self, step: int) -> None:
        """P > 1: this partition stored its lists of ``step``; a partition other than 0
        is done with it and older checkpoints (partition 0 keeps them until it merged)."""
        self.last_searched = step
        if not self.announces:
            for old in [s for s in self.plans if s <= step]:
                self.forget(old)

    # -- events -----------------------------------------------------------------------------
    def add_plan(self, received: Received[CheckpointPublished], stored: Callable[[], set[str]]
                 ) -> None:
        """A ``checkpoint.published``; ``stored``: the keys of its shards already in the store
        (they count: an indexer restarted mid-refresh loses nothing)."""
        step = received.event.step
        if step in self.plans or self.built(step) or step in self.abandoned:
            return  # a duplicate or stale event
        if not self.announces and self.searched_through(step):
            return  # this partition's part is done; partition 0 keeps plans until merged
        self.published_at[step] = entry_seconds(received.entry_id)
        self.published[step] = received.event
        self.plans[step] = received.event.plan
        self.received[step] = stored()

    def shard_encoded(self, received: Received[ShardEncoded], needed: Needed) -> None:
        """A ``shard.encoded`` (duplicates and late shards of an old checkpoint change
        nothing); notes when it completes this process's part of a plan."""
        event = received.event
        step = event.step
        if self.built(step):
            return
        keys = self.received.setdefault(step, set())
        keys.add(event.key)
        plan = self.plans.get(step)
        if self.announces:  # may come before its checkpoint.published is read
            self.shard_events.setdefault(step, {})[event.key] = event
        if plan is not None and step not in self.completed_at and needed(plan) <= keys:
            self.completed_at[step] = entry_seconds(received.entry_id)
            self.completed_wall[step] = time.time()

    def timeline_event(self, event: ShardEncoded) -> None:
        """On recovery: a pending refresh's ``shard.encoded``, for its timeline."""
        if self.announces and event.step in self.plans:
            self.shard_events.setdefault(event.step, {})[event.key] = event

    def partition_searched(self, event: PartitionSearched) -> None:
        """Partition 0 notes which partitions stored their lists of which checkpoint."""
        if (self.announces and event.partitions == self.partitions
                and not self.built(event.step)):
            self.searched.setdefault(event.step, {})[event.partition] = event

    def abandon(self, step: int) -> bool:
        """Drop the plan of a checkpoint that can never be complete (``shard.failed``).
        Returns False when it is built, already abandoned or complete after all."""
        plan = self.plans.get(step)
        if self.built(step) or step in self.abandoned or (
                plan is not None and plan.expected_keys() <= self.received.get(step, set())):
            return False
        self.abandoned.add(step)
        self.forget(step)
        return True

    # -- what to do next (protocol/supersession.py) -----------------------------------------
    def newest_complete(self, needed: Needed, after: int | None) -> int | None:
        """The newest checkpoint this process has its part of and has not done yet (newer
        than ``after``, by the supersession rule)."""
        complete = {step: needed(plan) <= self.received.get(step, set())
                    for step, plan in self.plans.items() if not self.searched_through(step)}
        return next_to_build(complete, after)

    def newest_mergeable(self) -> int | None:
        """Partition 0: the checkpoint to merge and announce next, among those not announced,
        by the same rule; complete = every partition's lists are stored."""
        ready = {step: len(self.searched.get(step, {})) == self.partitions
                 for step in self.plans if not self.built(step)}
        return next_to_build(ready, self.last_built)

    def encoding_now(self, needed: Needed) -> int | None:
        """The checkpoint whose shards are arriving: checkpoint 0 while it is pending (it is
        built first), else the pending one with the most of this process's shards in the
        store (the refresh under way; a tie goes to the newest)."""
        pending = [step for step in self.plans if not self.searched_through(step)]
        if not pending:
            return None
        if ZERO_SHOT_STEP in pending:
            return ZERO_SHOT_STEP
        return max(pending, key=lambda step: (
            len(needed(self.plans[step]) & self.received.get(step, set())), step))
