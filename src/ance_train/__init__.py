"""ance-train: dense retrievers trained with globally mined, asynchronously refreshed ANN negatives.

The three services are the packages ``trainer``, ``inferencer`` and ``indexer``; what travels
between them is defined once in ``protocol``. See docs/architecture.md ("Where does X live").
From Python: ``from ance_train import Run`` (:mod:`ance_train.api`).
"""

from typing import Any

__all__ = ["Run"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the CLI) does not load torch and the services.
    if name == "Run":
        from ance_train.api import Run

        return Run
    raise AttributeError(f"module 'ance_train' has no attribute {name!r}")
