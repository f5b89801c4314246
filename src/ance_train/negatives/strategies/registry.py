"""The registry of negative strategies: configuration name → strategy class.

Adding a strategy is one new module in this package (a subclass of ``PoolStrategy``,
``SamplingStrategy`` or ``LossStrategy`` from :mod:`.base`, documented like the others) and
one line below. The configuration reads the registry: ``negatives.pool`` and
``negatives.sampling`` accept the names of the registered strategies of that role.
"""

from __future__ import annotations

from ance_train.negatives.strategies import (
    ance,
    bm25,
    bm25_random,
    dance,
    in_batch,
    random,
    simans,
    tele,
)
from ance_train.negatives.strategies.base import NegativeStrategy, Role

STRATEGIES: dict[str, type[NegativeStrategy]] = {
    strategy.name: strategy
    for strategy in (
        in_batch.InBatchPool,
        random.RandomPool,
        bm25.Bm25Pool,
        bm25_random.Bm25RandomPool,
        ance.AnnPool,
        tele.TelePool,
        ance.UniformSampling,
        simans.SimansSampling,
        dance.DanceLoss,
    )
}


def names(role: Role) -> list[str]:
    """The registered strategies of one role, in registration order."""
    return [name for name, strategy in STRATEGIES.items() if strategy.role == role]


def lookup(name: str, role: Role) -> type[NegativeStrategy]:
    """The strategy class registered as ``name`` for ``role``; ``KeyError`` naming the
    registered ones otherwise."""
    strategy = STRATEGIES.get(name)
    if strategy is None or strategy.role != role:
        raise KeyError(f"unknown {role} {name!r}; registered: {', '.join(names(role))}")
    return strategy
