"""The strategy registry (negatives/strategies/registry.py): every name resolves, an unknown one
is a configuration error naming the registered ones, each strategy module documents its
paper, and a new strategy works from one module plus its registration."""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import replace
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import yaml
from pydantic import Field

from ance_train.config import ConfigError, NegativesConfig, dump_config, parse_config
from ance_train.data.dataset import DatasetIndex
from ance_train.index.ann import AnnIndex
from ance_train.negatives.mining import Miner
from ance_train.negatives.strategies import registry
from ance_train.negatives.strategies.ance import AnnPool
from ance_train.negatives.strategies.base import (
    LossStrategy,
    PoolStrategy,
    SamplingStrategy,
    StrategySettings,
)
from ance_train.negatives.strategies.random import RandomNegatives
from ance_train.negatives.table import PAD, uniform_probabilities
from ance_train.protocol.tables import TableId
from ance_train.trainer.negative_sources import NegativesPicker

POOLS = ["in_batch", "random", "bm25", "bm25_random", "ann", "tele"]
BASES = {"pool": PoolStrategy, "sampling": SamplingStrategy, "loss": LossStrategy}


def test_every_registered_name_resolves_to_its_strategy() -> None:
    assert registry.names("pool") == POOLS
    assert registry.names("sampling") == ["uniform", "simans"]
    assert registry.names("loss") == ["dance"]
    for name, strategy in registry.STRATEGIES.items():
        assert strategy.name == name
        assert issubclass(strategy, BASES[strategy.role])
        assert registry.lookup(name, strategy.role) is strategy
        bound = NegativesConfig().strategy(name)
        assert isinstance(bound, strategy)
        if strategy.settings_model is not None:  # its section exists, with its defaults
            assert bound.settings == strategy.settings_model()


@pytest.mark.parametrize("pool", POOLS)
def test_every_pool_is_a_valid_configuration(pool: str) -> None:
    cfg = parse_config({"data": {"path": "d"}, "negatives": {"pool": pool, "warmup": "none"}})
    assert type(cfg.negatives.pool_strategy) is registry.STRATEGIES[pool]
    assert cfg.negatives.mines_ann == (pool in ("ann", "tele"))
    assert cfg.negatives.uses_bm25 == (pool in ("bm25", "bm25_random"))


@pytest.mark.parametrize("sampling", ["uniform", "simans"])
def test_every_sampling_is_a_valid_configuration(sampling: str) -> None:
    cfg = parse_config({"data": {"path": "d"}, "negatives": {"sampling": sampling}})
    assert type(cfg.negatives.sampling_strategy) is registry.STRATEGIES[sampling]


@pytest.mark.parametrize(("negatives", "field", "role"), [
    ({"pool": "hardest"}, "negatives.pool", "pool"),
    ({"pool": "simans"}, "negatives.pool", "pool"),          # a sampling, not a pool
    ({"sampling": "hardest"}, "negatives.sampling", "sampling"),
    ({"sampling": "tele"}, "negatives.sampling", "sampling"),  # a pool, not a sampling
])
def test_an_unknown_name_is_a_configuration_error(negatives: dict, field: str,
                                                  role: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": "d"}, "negatives": negatives})
    message = str(info.value)
    assert field in message and f"unknown {role}" in message, message
    assert ", ".join(registry.names(role)) in message  # the choices are listed
    with pytest.raises(KeyError):
        registry.lookup(next(iter(negatives.values())), role)


def test_each_strategy_module_cites_its_paper_and_equation() -> None:
    """Like sentence-transformers' losses: title, venue and arXiv id, and the equation, in
    the module's docstring; never a file name of ours (the seeds are ``00N_<hash>.txt``)."""
    modules = {sys.modules[strategy.__module__] for strategy in registry.STRATEGIES.values()}
    assert len(modules) == 8
    for module in modules:
        doc = module.__doc__ or ""
        assert re.search(r"arXiv:\d{4}\.\d{5}", doc), module.__name__
        assert re.search(r"\b(ICLR|EMNLP|ICTIR)\s+20\d\d\b", doc), module.__name__
        assert re.search(r'"[A-Z][^"]{20,}"', doc), module.__name__  # the title, quoted
        assert re.search(r"\bEq\. \d+", doc), module.__name__
        assert not re.search(r"\d{3}_[0-9a-f]{6,}|\.txt\b", doc), module.__name__


# --------------------------------------------------------------------------- an eighth one


class NearestSettings(StrategySettings):
    keep: int = Field(2, ge=1)


class NearestPool(AnnPool):
    """A toy pool: the ``keep`` nearest ANN candidates of each query, uniformly."""

    name = "nearest"
    remines = False
    settings_model = NearestSettings
    legacy_keys = MappingProxyType({"nearest_keep": "keep"})

    def mine(self, miner, refresh):
        candidates = refresh.candidates.copy()
        candidates[:, self.settings.keep:] = PAD
        return miner.table(replace(refresh, candidates=candidates,
                                   probabilities=uniform_probabilities(candidates)))


def _world(seed: int = 3, num_docs: int = 40, num_queries: int = 6, dim: int = 8):
    rng = np.random.default_rng(seed)
    docs = rng.normal(size=(num_docs, dim)).astype(np.float32)
    queries = rng.normal(size=(num_queries, dim)).astype(np.float32)
    train_ids = [f"q{i}" for i in range(num_queries)]
    nearest = np.argsort(-(queries @ docs.T), axis=1)
    train = {q: {int(nearest[i, 1]): 1} for i, q in enumerate(train_ids)}  # the 2nd nearest
    dataset = DatasetIndex(format="beir", num_docs=num_docs,
                           queries={q: q for q in train_ids}, train=train, dev={}, test={},
                           warnings=[], empty_doc_count=0)
    index = AnnIndex(dim)
    index.add(np.arange(num_docs), docs)
    index.finalize()
    return docs, queries, train_ids, train, dataset, index, nearest


def test_an_eighth_strategy_works_from_its_class_and_one_registration(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    raw = {"data": {"path": "d"},
           "negatives": {"pool": "nearest", "nearest": {"keep": 3}, "warmup": "none"}}
    with pytest.raises(ConfigError) as info:  # not registered: neither the name nor the section
        parse_config(raw)
    assert "negatives.pool" in str(info.value) and "negatives.nearest: unknown field" in str(
        info.value)

    monkeypatch.setitem(registry.STRATEGIES, "nearest", NearestPool)  # the registration line

    # Configuration: the name, the section (validated, dumped, read back), the old key.
    cfg = parse_config(raw)
    assert cfg.negatives.nearest.keep == 3 and "nearest" in registry.names("pool")
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"negatives\.nearest\.keep"):
        parse_config({**raw, "negatives": {"pool": "nearest", "nearest": {"keep": 0}}})
    with caplog.at_level(logging.WARNING, logger="ance_train.config"):
        old = parse_config({**raw, "negatives": {"pool": "nearest", "nearest_keep": 3,
                                                 "warmup": "none"}})
    assert old == cfg and "negatives.nearest.keep" in caplog.text
    # The inherited checks of an ANN pool apply to it.
    with pytest.raises(ConfigError, match=r"negatives\.per_query"):
        parse_config({**raw, "negatives": {"pool": "nearest", "per_query": 5, "top_k": 4}})

    # Indexer side: the miner hands the refresh's candidates to the pool.
    neg = cfg.negatives
    assert neg.mines_ann and not neg.uses_bm25
    docs, queries, train_ids, train, dataset, index, nearest = _world()
    miner = Miner(neg, 1.0, dataset, train_ids, seed=0)
    ranked, sims = index.search(queries, miner.depth() + miner.max_positives)
    table = miner.mine(5, index, queries, ranked, sims, previous=None)
    for row, qid in enumerate(train_ids):
        expected = [int(d) for d in nearest[row] if int(d) not in train[qid]][:3]
        got = table.candidates[row]
        assert got[got != PAD].tolist() == expected
        np.testing.assert_allclose(table.probabilities[row, :3], 1 / 3, rtol=1e-6)

    # Trainer side: the picker takes the step's negatives from the pool's source.
    holder = SimpleNamespace(bm25=None, ann=None, dual=None)
    picker = NegativesPicker(neg, holder, RandomNegatives(len(docs), {}))
    assert picker.needs_wait() and not picker.ready()
    holder.ann = table
    assert picker.pick(1) == (table, TableId.ann(5))
