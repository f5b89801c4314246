"""The strategy registry (the entry points read by ``config.registered_strategies``,
negatives/strategies/registry.py): every name resolves, an unknown one is a configuration
error naming the registered ones, each strategy module documents its paper, a new strategy
works from one module plus its entry point (another package's too), a broken registration is
an error naming its distribution, and the configuration imports no strategy to do this."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import yaml
from pydantic import Field

from ance_train.config import (
    STRATEGY_ENTRY_POINTS,
    ConfigError,
    NegativesConfig,
    StrategyRegistryError,
    dump_config,
    parse_config,
    registered_strategies,
)
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
    assert list(registry.strategies()) == [*POOLS, "uniform", "simans", "dance"]
    for name, strategy in registry.strategies().items():
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
    assert type(cfg.negatives.pool_strategy) is registry.strategies()[pool]
    assert cfg.negatives.mines_ann == (pool in ("ann", "tele"))
    assert cfg.negatives.uses_bm25 == (pool in ("bm25", "bm25_random"))


@pytest.mark.parametrize("sampling", ["uniform", "simans"])
def test_every_sampling_is_a_valid_configuration(sampling: str) -> None:
    cfg = parse_config({"data": {"path": "d"}, "negatives": {"sampling": sampling}})
    assert type(cfg.negatives.sampling_strategy) is registry.strategies()[sampling]


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
    modules = {sys.modules[strategy.__module__] for strategy in registry.strategies().values()}
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


def _distribution(root: Path, name: str, entries: dict[str, str]) -> Path:
    """A distribution ``name`` 0.0 installed in ``root`` as pip would leave one (its
    ``.dist-info`` folder: METADATA and entry_points.txt), declaring ``entries``
    (strategy name → ``module:Class``) in the strategies' group. ``root`` goes on the path."""
    info = root / f"{name.replace('-', '_')}-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    lines = [f"[{STRATEGY_ENTRY_POINTS}]", *(f"{key} = {value}" for key, value in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Distributions laid on ``sys.path`` by the test (``installed.syspath_prepend``), read
    by the registry from the next call on, and gone from it afterwards."""
    registered_strategies.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    registered_strategies.cache_clear()


def test_an_eighth_strategy_works_from_its_class_and_one_entry_point(
    installed: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = {"data": {"path": "d"},
           "negatives": {"pool": "nearest", "nearest": {"keep": 3}, "warmup": "none"}}
    with pytest.raises(ConfigError) as info:  # not registered: neither the name nor the section
        parse_config(raw)
    assert "negatives.pool" in str(info.value) and "negatives.nearest: unknown field" in str(
        info.value)

    # The registration: one entry point, in a distribution of its own.
    installed.syspath_prepend(str(_distribution(
        tmp_path, "nearest-pool", {"nearest": f"{NearestPool.__module__}:NearestPool"})))
    registered_strategies.cache_clear()

    # Configuration: the name, the section (validated, dumped, read back), the old key.
    cfg = parse_config(raw)
    assert cfg.negatives.nearest.keep == 3
    # Listed by its order (AnnPool's, inherited), then name.
    assert registry.names("pool") == [*POOLS[:5], "nearest", "tele"]
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


# ------------------------------------------------------------- another package's strategies

MY_NEGATIVES = '''
"""A package of one's own with a pool of its own: random documents, a share of them kept."""
from typing import ClassVar

from pydantic import Field

from ance_train.negatives.strategies.base import PoolStrategy, StrategySettings


class MyPoolSettings(StrategySettings):
    share: float = Field(0.5, gt=0.0, le=1.0)


class MyPool(PoolStrategy):
    name: ClassVar[str] = "my_pool"
    settings_model = MyPoolSettings

    def source(self, tables, random):
        return random, None
'''

OUTSIDE_RUN = '''
import json
from ance_train.config import ConfigError, RunConfig, parse_config, strategy_names

cfg = RunConfig(data={"path": "d"},
                negatives={"pool": "my_pool", "my_pool": {"share": 0.25}, "warmup": "none"})
errors = []
for section in ({"share": 2}, {"shares": 0.3}):
    try:
        parse_config({"data": {"path": "d"}, "negatives": {"pool": "my_pool", "my_pool": section}})
    except ConfigError as error:
        errors.append(str(error))
print(json.dumps({
    "class": type(cfg.negatives.pool_strategy).__module__ + ":"
             + type(cfg.negatives.pool_strategy).__qualname__,
    "share": cfg.negatives.my_pool.share,
    "default": RunConfig(data={"path": "d"}).negatives.my_pool.share,
    "pools": strategy_names("pool"),
    "errors": errors,
}))
'''


def _python(code: str, cwd: Path, pythonpath: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter of this environment; its stdout."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_strategy_of_another_installed_package_is_accepted(tmp_path: Path) -> None:
    """A package outside ance-train registers a pool by an entry point of its own
    distribution: the configuration accepts its name and validates its section."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "my_negatives.py").write_text(MY_NEGATIVES)
    _distribution(site, "my-negatives", {"my_pool": "my_negatives:MyPool"})
    result = json.loads(_python(OUTSIDE_RUN, cwd=tmp_path, pythonpath=site))
    assert result["class"] == "my_negatives:MyPool"
    assert result["share"] == 0.25 and result["default"] == 0.5
    assert result["pools"] == [*POOLS, "my_pool"]  # the default order: after the built-in ones
    too_big, unknown = result["errors"]
    assert "negatives.my_pool.share" in too_big and "less than or equal to 1" in too_big
    assert "negatives.my_pool.shares: unknown field (did you mean negatives.my_pool.share?)" \
        in unknown


def test_two_registrations_of_one_name_are_an_error_naming_both(
    installed: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    installed.syspath_prepend(str(_distribution(
        tmp_path, "other-ann", {"ann": "ance_train.negatives.strategies.ance:AnnPool"})))
    with pytest.raises(StrategyRegistryError) as info:
        registered_strategies()
    message = str(info.value)
    assert "negative strategy 'ann' is registered twice" in message, message
    assert "of distribution other-ann 0.0" in message and "of distribution ance-train" in message
    assert "'ance_train.negatives.strategies.ance:AnnPool'" in message
    with pytest.raises(ConfigError, match="registered twice"):  # what `validate` prints
        parse_config({"data": {"path": "d"}})


@pytest.mark.parametrize(("entry", "problem"), [
    ({"closest": f"{NearestPool.__module__}:NearestPool"},
     "gives the class NearestPool, whose name is 'nearest': the entry point's name must be"),
    ({"settings": f"{NearestSettings.__module__}:NearestSettings"},
     "gives the class NearestSettings, whose name is None"),
    ({"nothing": "no_such_module_here:Pool"},
     "does not load: ModuleNotFoundError: No module named 'no_such_module_here'"),
])
def test_a_broken_registration_is_an_error_naming_its_entry_point(
    installed: pytest.MonkeyPatch, tmp_path: Path, entry: dict[str, str], problem: str
) -> None:
    installed.syspath_prepend(str(_distribution(tmp_path, "broken-plugin", entry)))
    with pytest.raises(StrategyRegistryError) as info:
        registered_strategies()
    name, value = next(iter(entry.items()))
    message = str(info.value)
    assert message.startswith(f"negative strategy {name!r}: the entry point {name!r} = "
                              f"{value!r} of distribution broken-plugin 0.0 "), message
    assert problem in message, message


def test_no_registered_strategy_says_to_install_the_package(tmp_path: Path) -> None:
    """The package run from a source tree that was never pip-installed: no entry points.
    (Here: every folder but the standard library's taken off the path after the imports,
    the environment's site-packages and the source tree, where `pip install -e` leaves
    metadata too, src/ance_train.egg-info.)"""
    output = _python('''
        import importlib, sys
        from ance_train.config import ConfigError, parse_config
        sys.path[:] = [p for p in sys.path
                       if p.startswith(sys.base_prefix) and "-packages" not in p]
        importlib.invalidate_caches()
        try:
            parse_config({"data": {"path": "d"}})
        except ConfigError as error:
            print(type(error).__name__, error)
    ''', cwd=tmp_path)
    assert output.startswith("StrategyRegistryError no negative strategy is registered: "), output
    assert "'ance_train.negative_strategies' are missing" in output
    assert "`pip install -e .`" in output


def test_importing_the_configuration_imports_no_strategy(tmp_path: Path) -> None:
    """config sits below every other layer (docs/architecture.md): importing it loads no other
    module of the package, the strategies least of all; they load at the first validation."""
    output = _python('''
        import json, sys
        import ance_train.config
        before = sorted(m for m in sys.modules if m.startswith("ance_train"))
        ance_train.config.parse_config({"data": {"path": "d"}})
        after = sorted(m for m in sys.modules if m.startswith("ance_train.negatives"))
        print(json.dumps([before, after]))
    ''', cwd=tmp_path)
    before, after = json.loads(output)
    assert before == ["ance_train", "ance_train.config"]
    assert "ance_train.negatives.strategies.tele" in after
