"""The registry of negative strategies: configuration name → strategy class.

The strategies are Python entry points of the group ``ance_train.negative_strategies``, the
only list of them: ance-train declares its own in its pyproject.toml, and any installed
package may declare more in its own (``[project.entry-points."ance_train.negative_strategies"]``,
``my_pool = "my_package.my_pool:MyPool"``). Adding a strategy is one module (a subclass of
``PoolStrategy``, ``SamplingStrategy`` or ``LossStrategy`` from :mod:`.base`, documented like
the others) plus one entry point line in pyproject.toml, then ``pip install -e .`` so that the
installed metadata lists it. The configuration reads the registry: ``negatives.pool`` and
``negatives.sampling`` accept the names of the registered strategies of that role, and each
strategy's section is validated with its settings model.

The configuration sits below the strategies (docs/architecture.md), so the loading and the
checks live there (:func:`ance_train.config.registered_strategies`), importing no strategy
module until a configuration is validated; this module gives them their registry names.
"""

from __future__ import annotations

from ance_train.config import STRATEGY_ENTRY_POINTS as GROUP
from ance_train.config import lookup_strategy as lookup
from ance_train.config import registered_strategies as strategies
from ance_train.config import strategy_names as names

__all__ = ["GROUP", "lookup", "names", "strategies"]
