"""What a negative strategy is: the protocol every strategy module implements.

A strategy plays one of three roles, chosen by one field of the ``negatives:`` section each
(they combine freely where the configuration allows it, see docs/strategies.md):

- a **pool** (``negatives.pool``) says where a query's hard negatives come from and is the
  trainer's source of them: in-batch only, random, BM25, BM25 + random, the ANN index (ANCE)
  or teleportation negatives (ANCE-Tele);
- a **sampling** (``negatives.sampling``) says how one negative is drawn from the candidates
  an ANN pool mined: uniformly (ANCE) or by SimANS's ambiguity weights;
- a **loss** adds a term to the trainer's loss from a table of its own (DANCE's dual
  query-retrieval loss, enabled by its weight).

A strategy class names itself (its registry key, the value written in the configuration),
may declare a settings model (:class:`StrategySettings`, read from the section
``negatives.<name>``) and the flat keys that held those settings before (still read, with a
deprecation message), rejects the combinations it cannot work with (:meth:`check`), and
implements its role's indexer side (mining) and trainer side (the source of its negatives).
Instances are bound to one ``negatives`` configuration. It is registered by an entry point
(:mod:`.registry`); what the configuration asks of it is
:class:`ance_train.config.StrategyClass`, which these bases satisfy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import numpy as np

# StrategySettings and the roles belong to the configuration, which validates the sections
# (re-exported here, where the strategies import them from).
from ance_train.config import StrategyRole, StrategySettings, strategy_names
from ance_train.negatives.table import NegativesTable

if TYPE_CHECKING:
    from ance_train.config import NegativesConfig, RunConfig
    from ance_train.negatives.mining import Miner
    from ance_train.negatives.strategies.random import RandomNegatives
    from ance_train.protocol.tables import TableId

Role = StrategyRole


class NegativeSource(Protocol):
    """What the trainer draws a batch's hard negatives from (document indices, never a
    positive of the query). A :class:`~ance_train.negatives.table.NegativesTable` is one."""

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]: ...

    def sample_many(self, query_ids: Sequence[str], n: int,
                    rng: np.random.Generator) -> list[list[int]]: ...


class PerQuerySource:
    """``sample_many`` as one ``sample`` per query (sources without a vectorised draw)."""

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        raise NotImplementedError

    def sample_many(self, query_ids: Sequence[str], n: int,
                    rng: np.random.Generator) -> list[list[int]]:
        return [self.sample(query_id, n, rng) for query_id in query_ids]


class TableHolder(Protocol):
    """The tables the trainer holds (the negatives feed): what a pool's source comes from."""

    bm25: NegativesTable | None
    ann: NegativesTable | None
    dual: NegativesTable | None


class MiningIndex(Protocol):
    """What mining asks of a refresh's index: an :class:`~ance_train.index.ann.AnnIndex`,
    a :class:`~ance_train.index.passages.PassageIndex` over one (MaxP), or the partitions'
    :class:`~ance_train.indexer.partitions.MergedIndex`."""

    def scores(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray: ...

    def best_vectors(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray: ...

    def search(self, queries: np.ndarray, k: int, batch_size: int = 1024,
               cancel: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]: ...


class VectorIndex(MiningIndex, Protocol):
    """An index with one vector per document (no MaxP), which it gives back: DANCE's."""

    def vectors(self, doc_ids: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class AnnRefresh:
    """One refresh's ANN candidates of the training queries (rows in ``Miner.train_ids``
    order), after positive removal and sampling: what an ANN pool turns into its table."""

    step: int
    index: MiningIndex
    queries: np.ndarray          # [Q, dim] training-query embeddings
    anchor_vectors: np.ndarray   # [Q, dim] embedding of d̃⁺, one positive drawn per query
    candidates: np.ndarray       # [Q, k] document indices, PAD where a row is short
    scores: np.ndarray           # [Q, k] s(q, d) = similarity / temperature
    positive_scores: np.ndarray  # [Q] s(q, d̃⁺)
    probabilities: np.ndarray    # [Q, k] the sampling strategy's distribution
    sources: np.ndarray          # [Q, k] SOURCE_CODE of each candidate
    depth: int                   # k: how deep the candidates go (the sampling's top-k)
    previous: NegativesTable | None
    rng: np.random.Generator
    cancel: Callable[[], None] | None = None  # called between search batches; may raise
    search_batch: int = 1024


class NegativeStrategy:
    """Base of every strategy; see the module docstring."""

    name: ClassVar[str]
    role: ClassVar[Role]
    #: The model of the section ``negatives.<name>`` (None: the strategy has no settings).
    settings_model: ClassVar[type[StrategySettings] | None] = None
    #: Deprecated flat keys of ``negatives`` → the field of ``settings_model`` they now are.
    legacy_keys: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: Where the strategy comes among its role's names in lists (messages, the registry):
    #: lower first, ties by name. The built-in ones are 10, 20, ...; the default puts a
    #: strategy of another package after them.
    order: ClassVar[int] = 1000

    def __init__(self, config: NegativesConfig) -> None:
        self.config = config

    @property
    def settings(self) -> Any:
        """This strategy's section of the configuration (an instance of ``settings_model``)."""
        return getattr(self.config, self.name)

    def check(self, run: RunConfig) -> None:
        """Reject a configuration this strategy cannot run with: raise ``ValueError`` naming
        the field. Called for the configured pool and sampling, and for every loss."""


class PoolStrategy(NegativeStrategy):
    """Where hard negatives come from (``negatives.pool``)."""

    role: ClassVar[Role] = "pool"
    #: False: the pool gives no hard negatives (the loss has the in-batch ones only).
    hard_negatives: ClassVar[bool] = True
    #: The trainer's first step has a table to wait for (``negatives.wait_for_first``).
    needs_table: ClassVar[bool] = False
    #: The indexer mines a table from the ANN index at every refresh (dense scores exist,
    #: so a score-based sampling such as SimANS can be used).
    mines_ann: ClassVar[bool] = False
    #: The indexer builds the BM25 table once at start-up.
    uses_bm25: ClassVar[bool] = False
    #: ``negatives.remine_fraction`` < 1 is meaningful for this pool.
    remines: ClassVar[bool] = False

    def mine(self, miner: Miner, refresh: AnnRefresh) -> NegativesTable | None:
        """Indexer side, at each refresh: this pool's table from the ANN candidates
        (pools with ``mines_ann`` only; the others have nothing to mine per refresh)."""
        return None

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        """Trainer side, at each step: the source of the step's hard negatives and the table
        it comes from (None when it is no table: random, in-batch), or ``(None, None)`` if
        there is none (yet)."""
        raise NotImplementedError


class SamplingStrategy(NegativeStrategy):
    """How a negative is drawn from an ANN pool's candidates (``negatives.sampling``)."""

    role: ClassVar[Role] = "sampling"
    #: The probabilities depend on the candidates' dense scores: the pool must mine ANN.
    needs_scores: ClassVar[bool] = False

    def depth(self) -> int:
        """How many ANN candidates (after positive removal) a query's row holds."""
        return self.config.top_k

    def probabilities(self, candidates: np.ndarray, scores: np.ndarray,
                      positive_scores: np.ndarray) -> np.ndarray:
        """Indexer side: each row's sampling distribution over its valid candidates."""
        raise NotImplementedError

    def check(self, run: RunConfig) -> None:
        pool = run.negatives.pool_strategy
        if self.needs_scores and not pool.mines_ann:
            # The cast: strategy_names("pool") lists the registered PoolStrategy subclasses.
            dense = " or ".join(n for n in strategy_names("pool")
                                if cast(PoolStrategy, run.negatives.strategy(n)).mines_ann)
            raise ValueError(f"negatives.sampling {self.name} needs dense scores: use it with "
                             f"pool {dense}, not {run.negatives.pool}")


class LossStrategy(NegativeStrategy):
    """An extra loss term with negatives of its own, mined by the indexer at each refresh."""

    role: ClassVar[Role] = "loss"

    @property
    def enabled(self) -> bool:
        raise NotImplementedError


if TYPE_CHECKING:
    from ance_train.config import StrategyClass

    # mypy: each role's base gives the configuration what it asks of a strategy class.
    _POOL: StrategyClass = PoolStrategy
    _SAMPLING: StrategyClass = SamplingStrategy
    _LOSS: StrategyClass = LossStrategy
