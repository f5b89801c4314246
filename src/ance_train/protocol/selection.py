"""Which checkpoint a run's dev evaluations select: ``ance-train export --checkpoint best``, and
``bench/quality.py``'s default ``--select auto``.

The rule is the highest dev nDCG@10, except where the dev split is too small to tell
checkpoints apart (fewer than :data:`~ance_train.config.MIN_DEV_QUERIES` queries): there it is
the **latest** checkpoint whose dev value reaches the lower end of the best's bootstrap 95%
interval (each eval report's ``ci95``), i.e. the most trained one that dev cannot call worse.

The evidence (issue 33, dev-side only): SciFact cut to 150 training queries leaves a 15-query
dev slice. Over three seeds of 60 steps, its dev nDCG@10 fell after step 15 while the 660
training queries the runs never saw (``bench/interpolation.py --heldout-data``) rose at every
checkpoint. The highest dev value picked steps 30, 15, 15 (held-out nDCG@10 0.6551); the rule
here picked 60 in every seed (0.6691; zero-shot 0.6441): ``docs/benchmarks/small-heldout.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ance_train.config import MIN_DEV_QUERIES


@dataclass(frozen=True)
class DevPoint:
    """One evaluated checkpoint: its dev value and the bootstrap 95% interval of it (None:
    not recorded)."""

    step: int
    value: float
    interval: tuple[float, float] | None = None


def interval(ci95: Sequence[float] | None) -> tuple[float, float] | None:
    """An eval report's ``ci95`` entry (``[low, high]``, JSON) as :attr:`DevPoint.interval`."""
    return None if ci95 is None else (float(ci95[0]), float(ci95[1]))


def best_step(points: Sequence[DevPoint]) -> int:
    """The highest dev value (the earliest of equals)."""
    if not points:
        raise ValueError("no evaluated checkpoint to select from")
    return max(points, key=lambda p: (p.value, -p.step)).step


def within_noise(points: Sequence[DevPoint]) -> list[int]:
    """The steps whose value reaches the lower end of the best's interval (the best alone
    when its interval is unknown), ascending."""
    step = best_step(points)
    best = next(p for p in points if p.step == step)
    if best.interval is None:
        return [step]
    return sorted(p.step for p in points if p.value >= best.interval[0])


def latest_within_noise(points: Sequence[DevPoint]) -> int:
    """The most trained checkpoint dev cannot call worse than the best."""
    return within_noise(points)[-1]


def earliest_within_noise(points: Sequence[DevPoint]) -> int:
    """The least trained checkpoint dev cannot call worse than the best."""
    return within_noise(points)[0]


def select_on_dev(points: Sequence[DevPoint], dev_queries: int | None) -> int:
    """The selected step: :func:`latest_within_noise` when the dev split has fewer than
    ``MIN_DEV_QUERIES`` queries, else :func:`best_step` (also when the count is unknown)."""
    if dev_queries is not None and dev_queries < MIN_DEV_QUERIES:
        return latest_within_noise(points)
    return best_step(points)
