"""The token ids an inferencer keeps between refreshes: a shard's rows (:class:`ShardRows`),
the bounded in-memory :class:`TokenCache`, and a shard being warmed into it slice by slice
(:class:`ShardWarming`). The corpus and the queries never change within a run, so once a
replica has tokenised a shard, every later refresh encodes straight from its ids; what the
ids depend on is the cache key (:meth:`~ance_train.inferencer.inferencer.Inferencer._token_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ance_train.protocol.work import ShardKind

# Texts an idle replica tokenises per turn of its claim loop when it warms its token cache:
# a few tens of milliseconds, the longest a newly published item waits for the replica.
WARM_SLICE = 32


@dataclass
class ShardRows:
    """What an item encodes, row by row: ``ids`` (document indices, or query ids), and with
    MaxP each row's passage number; ``texts`` or, from the :class:`TokenCache`, ``token_ids``."""

    ids: np.ndarray
    passages: np.ndarray | None = None
    texts: list[str] | None = None
    token_ids: list | None = None


class TokenCache:
    """Token ids of shards, in this process's memory, up to ``max_bytes`` (4 bytes a token;
    shards beyond it are not kept). A key names everything the ids depend on: the shard's
    kind and range, the length cap, the prompt, the passage setting and the checkpoint files
    other than the weights (tokenizer included: :attr:`ModelCache.fingerprint`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: dict[tuple, ShardRows] = {}

    def get(self, key: tuple) -> ShardRows | None:
        return self._rows.get(key)

    def put(self, key: tuple, rows: ShardRows) -> bool:
        """Keep ``rows`` under ``key``; False when they do not fit in what is left."""
        assert rows.token_ids is not None
        if key in self._rows:
            return True
        size = 4 * sum(len(row) for row in rows.token_ids) + rows.ids.nbytes
        if self.bytes + size > self.max_bytes:
            return False
        self._rows[key] = ShardRows(
            rows.ids, rows.passages,
            token_ids=[np.asarray(row, dtype=np.int32) for row in rows.token_ids])
        self.bytes += size
        return True


@dataclass
class ShardWarming:
    """A shard being tokenised into the :class:`TokenCache` slice by slice, ``offset`` the
    next document (or query) of ``[start, stop)`` to tokenise."""

    key: tuple
    kind: ShardKind
    start: int
    stop: int
    offset: int
    parts: list[ShardRows]

    def rows(self) -> ShardRows:
        """The slices joined: the shard's rows as ``Inferencer._rows`` and
        :func:`~ance_train.modeling.encoding.tokenize_texts` give them in one call (each
        text is tokenised on its own)."""
        passages = [p.passages for p in self.parts if p.passages is not None]
        return ShardRows(np.concatenate([p.ids for p in self.parts]),
                         np.concatenate(passages) if passages else None,
                         token_ids=[row for p in self.parts for row in p.token_ids or ()])
