"""Settings from the environment that more than one module reads the same way."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Which index partition an indexer process is (the embedded launcher sets it; a StatefulSet
# pod's name says it otherwise: ance_train.indexer.partitions.partition_number).
PARTITION_VAR = "ANCE_INDEX_PARTITION"

TRUE_SPELLINGS = frozenset({"1", "true", "yes", "on"})
FALSE_SPELLINGS = frozenset({"", "0", "false", "no", "off"})


def env_flag(name: str, env: Mapping[str, str] = os.environ,
             error: type[Exception] = ValueError) -> bool:
    """The boolean environment variable ``name``: false when unset or empty.

    Accepted (case-insensitive, surrounding white space ignored): ``1``/``true``/``yes``/``on``
    and ``0``/``false``/``no``/``off``. Anything else raises ``error`` (the caller's own error
    type) naming the variable and the value found.
    """
    raw = env.get(name, "").strip().lower()
    if raw in TRUE_SPELLINGS:
        return True
    if raw in FALSE_SPELLINGS:
        return False
    raise error(f"{name} must be 0 or 1, got {raw!r}")
