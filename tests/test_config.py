"""Tests of the run configuration (src/ance_train/config.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ance_train.config import (
    ConfigError,
    RunConfig,
    TrainingConfig,
    default_model_path,
    dump_config,
    load_config,
    parse_config,
    registered_strategies,
)

from ance_train_dev.helpers import write_config


def _load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    data = tmp_path / "dataset"
    data.mkdir()
    cfg = load_config(write_config(tmp_path / "run.yaml", data={"path": str(data)}))
    assert isinstance(cfg, RunConfig)
    assert cfg.data.path == str(data)
    assert cfg.data.format == "beir"
    assert cfg.data.dev_fraction == 0.1
    assert cfg.run_id == "ance-run"
    assert cfg.model.path == default_model_path()
    assert cfg.model.pooling == "mean"
    assert cfg.model.projection_dim is None
    assert cfg.model.similarity == "dot"
    assert cfg.model.temperature == 1.0
    assert cfg.training.steps == 1000
    assert cfg.training.batch_size == 16
    assert cfg.negatives.per_query == 1
    assert cfg.training.in_batch_negatives is True
    assert cfg.negatives.warmup == "bm25"
    assert cfg.negatives.pool == "ann" and cfg.negatives.sampling == "uniform"
    assert cfg.inference.replicas == 2
    assert cfg.negatives.top_k == 200
    assert cfg.negatives.bm25.top_k == 100
    # Paper defaults: SimANS a=0.5, b=0, k=100; ANCE-Tele α=β=0.5; DANCE λ=0.1 when enabled.
    assert (cfg.negatives.simans.a, cfg.negatives.simans.b) == (0.5, 0.0)
    assert cfg.negatives.simans.top_k == 100
    assert cfg.negatives.tele.momentum_weight == cfg.negatives.tele.lookahead_weight == 0.5
    assert cfg.index.eval_splits == ["dev", "test"]
    assert cfg.services.trainer_port == 0
    assert cfg.training.max_restarts == 3  # the chart's trainer.maxRestarts


def test_negative_max_restarts_is_named(tmp_path: Path) -> None:
    data = tmp_path / "dataset"
    data.mkdir()
    path = write_config(tmp_path / "run.yaml", data={"path": str(data)},
                        training={"processes": 2, "max_restarts": -1})
    assert "max_restarts" in _load_error(path)


def test_threads_between_refreshes_are_for_one_trainer_process(tmp_path: Path) -> None:
    data = tmp_path / "dataset"
    data.mkdir()
    path = write_config(tmp_path / "run.yaml", data={"path": str(data)},
                        training={"processes": 2, "torch_threads_between_refreshes": 2})
    assert "torch_threads_between_refreshes is for one trainer process" in _load_error(path)


def test_unknown_field_is_named(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": "d"}, training={"stpes": 10})
    message = _load_error(path)
    assert "training.stpes" in message
    assert "unknown field" in message
    assert str(path) in message


def test_unknown_top_level_field_is_named(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": "d"}, trainig={"steps": 10})
    message = _load_error(path)
    assert "trainig" in message and "unknown field" in message


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"training": {"steps": -5}}, "training.steps"),
        ({"training": {"steps": 0}}, "training.steps"),
        ({"negatives": {"per_query": 300}}, "negatives.per_query"),
        ({"negatives": {"per_query": 11, "top_k": 10}}, "negatives.per_query"),
        ({"negatives": {"pool": "bm25", "sampling": "simans"}}, "negatives.sampling"),
        ({"negatives": {"pool": "bm25", "warmup_steps": 5}}, "negatives.warmup_steps"),
        ({"negatives": {"pool": "random", "warmup": "none", "warmup_steps": 5}},
         "negatives.warmup_steps"),
        ({"negatives": {"pool": "tele", "remine_fraction": 0.5}}, "negatives.remine_fraction"),
        ({"negatives": {"pool": "bm25", "max_positive_ratio": 0.95}},
         "negatives.max_positive_ratio"),
        ({"negatives": {"max_positive_ratio": 0}}, "negatives.max_positive_ratio"),
        ({"negatives": {"dance": {"dual_weight": 0.1}}}, "negatives.dance.dual_weight"),
        ({"negatives": {"pool": "hardest"}}, "negatives.pool"),
        ({"model": {"pooling": "max"}}, "model.pooling"),
        ({"model": {"temperature": 0}}, "model.temperature"),
        ({"inference": {"claim_timeout_s": -1}}, "inference.claim_timeout_s"),
        ({"inference": {"precision": "fp8"}}, "inference.precision"),
        ({"data": {"path": "d", "dev_fraction": 1.0}}, "data.dev_fraction"),
        ({"run_id": "My-Run"}, "run_id"),
        ({"run_id": "-leading-dash"}, "run_id"),
    ],
)
def test_impossible_values_name_the_field(tmp_path: Path, sections: dict, field: str) -> None:
    raw = {"data": {"path": "d"}, **sections}
    path = write_config(tmp_path / "run.yaml", **raw)
    message = _load_error(path)
    assert field in message, message
    assert str(path) in message


def test_no_negatives_at_all_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": "d"},
                        training={"in_batch_negatives": False}, negatives={"pool": "in_batch"})
    message = _load_error(path)
    assert "negatives.pool" in message and "in_batch_negatives" in message


def test_every_bad_field_is_listed(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": "d"},
                        training={"steps": -1, "batch_size": 0}, model={"pooling": "max"})
    message = _load_error(path)
    for field in ("training.steps", "training.batch_size", "model.pooling"):
        assert field in message


def test_missing_data_section_is_named(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", training={"steps": 10})
    message = _load_error(path)
    assert "data" in message and "required" in message.lower()


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "", "42\n"])
def test_non_mapping_yaml_names_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "weird.yaml"
    path.write_text(text)
    message = _load_error(path)
    assert str(path) in message
    assert "mapping" in message


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("data:\n  path: [unclosed\ntraining: {steps: 3\n")
    message = _load_error(path)
    assert str(path) in message
    assert "YAML" in message


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    message = _load_error(path)
    assert str(path) in message


def test_relative_paths_resolve_against_the_config_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "configs" / "nested"
    config_dir.mkdir(parents=True)
    # An existing directory: "models/tiny" that does not exist would be a Hub id (org/name).
    (config_dir / "models" / "tiny").mkdir(parents=True)
    path = write_config(config_dir / "run.yaml", output_dir="../out",
                        data={"path": "../data/scifact"}, model={"path": "models/tiny"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.data.path == str(tmp_path / "configs" / "data" / "scifact")
    assert cfg.model.path == str(config_dir / "models" / "tiny")
    assert cfg.output_dir == str(tmp_path / "configs" / "out")
    # The same file loaded through a relative path gives the same result.
    monkeypatch.chdir(tmp_path)
    assert load_config(Path("configs/nested/run.yaml")) == cfg


def test_absolute_data_path_is_kept(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": "/srv/datasets/msmarco",
                                                     "format": "msmarco"})
    assert load_config(path).data.path == "/srv/datasets/msmarco"


def test_dump_and_parse_round_trip(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "run.yaml",
        run_id="round-trip-1",
        output_dir="out",
        data={"path": "data", "max_train_queries": 50, "dev_fraction": 0.2},
        model={"pooling": "cls", "projection_dim": 24, "similarity": "cosine",
               "temperature": 0.05},
        training={"steps": 7, "mixed_precision": "off"},
        negatives={"pool": "tele", "sampling": "simans", "per_query": 3, "top_k": 20},
        inference={"replicas": 3, "claim_timeout_s": 2.5},
        index={"eval_splits": ["test"]},
        services={"indexer_port": 50051},
    )
    cfg = load_config(path)
    text = dump_config(cfg)
    again = parse_config(yaml.safe_load(text))
    assert again == cfg
    assert again.model.projection_dim == 24
    assert again.index.eval_splits == ["test"]
    assert dump_config(again) == text
    # Written to a file elsewhere and loaded back: the resolved paths are absolute and stay put.
    copy = tmp_path / "elsewhere" / "copy.yaml"
    copy.parent.mkdir()
    copy.write_text(text)
    assert load_config(copy) == cfg


def test_parse_config_error_names_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": "d"}, "negatives": {"top_k": 0}}, source="configmap")
    assert "configmap" in str(info.value)
    assert "negatives.top_k" in str(info.value)


# Every deprecated flat key of ``negatives``, the nested key it became and a non-default value.
LEGACY_KEYS = [
    ("bm25_top_k", ("bm25", "top_k"), 30),
    ("simans_a", ("simans", "a"), 0.3),
    ("simans_b", ("simans", "b"), 0.1),
    ("simans_top_k", ("simans", "top_k"), 50),
    ("tele_momentum_weight", ("tele", "momentum_weight"), 0.2),
    ("tele_lookahead_weight", ("tele", "lookahead_weight"), 0.7),
    ("tele_max_candidates", ("tele", "max_candidates"), 90),
    ("dual_weight", ("dance", "dual_weight"), 0.1),
    ("dual_per_positive", ("dance", "per_positive"), 2),
    ("dual_top_k", ("dance", "top_k"), 20),
]


def test_every_deprecated_key_is_listed_here() -> None:
    registered = {old: (name, new) for name, strategy in registered_strategies().items()
                  for old, new in strategy.legacy_keys.items()}
    assert registered == {old: new for old, new, _ in LEGACY_KEYS}


def test_old_flat_keys_load_as_the_nested_form_with_a_deprecation_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flat = {old: value for old, _, value in LEGACY_KEYS}
    nested: dict = {}
    for _, (section, field), value in LEGACY_KEYS:
        nested.setdefault(section, {})[field] = value
    common = {"data": {"path": "d"}, "model": {"similarity": "cosine"}}
    with caplog.at_level(logging.WARNING, logger="ance_train.config"):
        new = load_config(write_config(tmp_path / "new.yaml", **common,
                                       negatives={"pool": "tele", **nested}))
    assert not caplog.records, "the nested form is not deprecated"
    with caplog.at_level(logging.WARNING, logger="ance_train.config"):
        old = load_config(write_config(tmp_path / "old.yaml", **common,
                                       negatives={"pool": "tele", **flat}))
    assert old == new
    assert old.negatives.simans.a == 0.3 and old.negatives.dance.per_positive == 2
    assert old.negatives.bm25.top_k == 30 and old.negatives.tele.max_candidates == 90
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == len(LEGACY_KEYS)
    for old_key, (section, field), _ in LEGACY_KEYS:
        assert any(f"negatives.{old_key} is deprecated" in m and f"negatives.{section}.{field}"
                   in m for m in messages), old_key
    # What the services receive (dump_config) is the nested form: no message there.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ance_train.config"):
        assert parse_config(yaml.safe_load(dump_config(old))) == old
    assert not caplog.records


def test_a_flat_key_fills_its_section_beside_nested_fields() -> None:
    cfg = parse_config({"data": {"path": "d"},
                        "negatives": {"simans_a": 0.3, "simans": {"top_k": 7}}})
    assert (cfg.negatives.simans.a, cfg.negatives.simans.b, cfg.negatives.simans.top_k) == (
        0.3, 0.0, 7)


@pytest.mark.parametrize(("old", "new", "negatives"), [
    ("simans_a", "simans.a", {"simans_a": 0.3, "simans": {"a": 0.4}}),
    ("tele_max_candidates", "tele.max_candidates",
     {"tele_max_candidates": 9, "tele": {"max_candidates": 9}}),
    ("dual_weight", "dance.dual_weight", {"dual_weight": 0.1, "dance": {"dual_weight": 0.1}}),
    ("bm25_top_k", "bm25.top_k", {"bm25": {"top_k": 5}, "bm25_top_k": 6}),
])
def test_old_and_new_key_together_is_an_error_naming_both(
    tmp_path: Path, old: str, new: str, negatives: dict
) -> None:
    message = _load_error(write_config(tmp_path / "run.yaml", data={"path": "d"},
                                       model={"similarity": "cosine"}, negatives=negatives))
    assert f"negatives.{old}" in message and f"negatives.{new}" in message, message


@pytest.mark.parametrize(("negatives", "field"), [
    ({"simans": {"c": 1}}, "negatives.simans.c"),
    ({"dance": {"dual_weight": 0.1, "weight": 0.1}}, "negatives.dance.weight"),
    ({"simans_c": 1}, "negatives.simans_c"),
    ({"ann": {"top_k": 3}}, "negatives.ann"),  # ANCE has no section of its own
])
def test_unknown_strategy_fields_are_named(tmp_path: Path, negatives: dict, field: str) -> None:
    message = _load_error(write_config(tmp_path / "run.yaml", data={"path": "d"},
                                       model={"similarity": "cosine"}, negatives=negatives))
    assert f"{field}: unknown field" in message, message


def test_strategy_section_values_are_validated() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": "d"},
                      "negatives": {"simans": {"a": 0}, "tele": "heavy", "per_query": -1}})
    message = str(info.value)
    for field in ("negatives.simans.a", "negatives.tele", "negatives.per_query"):
        assert field in message, message


# ----------------------------------------------------------- issue 30: --set, keys, no-ops


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    """``--set KEY.PATH=VALUE`` lays YAML values over the file, deep paths included, and
    validation sees the result (an override can make a valid file invalid and vice versa)."""
    from ance_train.config import apply_overrides, parse_override

    path = write_config(tmp_path / "run.yaml", data={"path": str(tmp_path)},
                        training={"steps": 10, "refresh_every": 5},
                        negatives={"sampling": "simans", "simans": {"top_k": 100, "a": 0.5}})
    cfg = load_config(path, ["training.steps=40", "training.learning_rate=5e-5",
                             "negatives.simans.a=0.3", "run_id=seeded",
                             "index.eval_splits=[test]"])
    assert cfg.training.steps == 40 and cfg.training.refresh_every == 5
    assert cfg.training.learning_rate == 5e-5  # YAML 1.1 reads 5e-5 as a string
    assert (cfg.negatives.simans.a, cfg.negatives.simans.top_k) == (0.3, 100)
    assert cfg.run_id == "seeded" and cfg.index.eval_splits == ["test"]
    with pytest.raises(ConfigError, match=r"training\.steps: Input should be greater"):
        load_config(path, ["training.steps=0"])
    with pytest.raises(ConfigError, match=r"with --set training\.stpes=3"):
        load_config(path, ["training.stpes=3"])
    with pytest.raises(ConfigError, match=r"training\.steps is not a section"):
        load_config(path, ["training.steps.x=1"])
    for bad in ("training.steps", "training..steps=1", "=3", ".a=1"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            parse_override(bad)
    raw: dict = {"negatives": {"simans": {"top_k": 100}}}
    apply_overrides(raw, ["negatives.simans.a=0.3", "data.path=inf"])
    assert raw == {"negatives": {"simans": {"top_k": 100, "a": 0.3}}, "data": {"path": "inf"}}


def test_a_key_given_twice_names_the_file_key_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run_id: twice\ndata:\n  path: /data/a\n  format: beir\ntraining:\n"
                    "  steps: 10\n  batch_size: 4\n  steps: 20\n")
    message = _load_error(path)
    assert str(path) in message and "'steps'" in message
    assert "line 6" in message and "line 8" in message
    # The same key in two different mappings, and a merge key overridden, are fine.
    path.write_text("run_id: once\ndata: &d {path: /data/a}\nindex: {eval_depth: 100}\n"
                    "training: {steps: 10}\n")
    assert load_config(path).training.steps == 10


def test_unknown_keys_get_the_closest_field_name(tmp_path: Path) -> None:
    path = write_config(tmp_path / "run.yaml", data={"path": str(tmp_path), "dev_fracton": 0.2},
                        training={"refresh_evry": 5, "zzzz": 1},
                        negatives={"simans": {"top_kk": 3}, "simns": {}},
                        index={"ivf": {"nprob": 3}})
    message = _load_error(path)
    assert f"invalid configuration in {path}" in message
    for line in ("data.dev_fracton: unknown field (did you mean data.dev_fraction?)",
                 "training.refresh_evry: unknown field (did you mean training.refresh_every?)",
                 "negatives.simans.top_kk: unknown field (did you mean negatives.simans.top_k?)",
                 "negatives.simns: unknown field (did you mean negatives.simans?)",
                 "index.ivf.nprob: unknown field (did you mean index.ivf.nprobe?)"):
        assert line in message, message
    assert "training.zzzz: unknown field\n" in message + "\n"  # nothing close: no guess


def _no_ops(tmp_path: Path, **negatives) -> list[str]:
    return load_config(write_config(tmp_path / "run.yaml", data={"path": str(tmp_path)},
                                    negatives=negatives)).no_op_settings()


def test_zero_negatives_per_query_with_a_mining_pool_is_warned(tmp_path: Path) -> None:
    [message] = _no_ops(tmp_path, pool="ann", per_query=0)
    assert "negatives.per_query is 0" in message and "mines an ANN negatives table" in message
    assert _no_ops(tmp_path, pool="ann", per_query=1) == []
    assert _no_ops(tmp_path, pool="in_batch", per_query=0) == []  # nothing is mined


def test_top_k_without_ann_candidates_is_warned(tmp_path: Path) -> None:
    [message] = _no_ops(tmp_path, pool="bm25", warmup="none", top_k=50)
    assert "negatives.top_k (50) is never read" in message and "pool bm25" in message
    assert _no_ops(tmp_path, pool="ann", top_k=50) == []
    assert _no_ops(tmp_path, pool="bm25", warmup="none") == []  # the default is not reported


def test_warmup_that_never_runs_is_warned(tmp_path: Path) -> None:
    [message] = _no_ops(tmp_path, pool="random", warmup="bm25")
    assert "negatives.warmup bm25 is never used" in message
    assert _no_ops(tmp_path, pool="random", warmup="bm25", warmup_steps=5) == []
    assert _no_ops(tmp_path, pool="ann", warmup="bm25") == []
    assert _no_ops(tmp_path, pool="random") == []  # the default warmup, not given: quiet


def test_checkpoint_steps_follow_one_rule() -> None:
    """Step 0, every refresh_every steps and the last: what the trainer's ranks save and what
    the capacity plan counts (``TrainingConfig.is_checkpoint_step``)."""
    from ance_train.config import TrainingConfig
    from ance_train.index.capacity import run_store_bytes

    training = TrainingConfig(steps=50, refresh_every=20, warmup_steps=1)
    assert training.checkpoint_steps() == [0, 20, 40, 50]
    assert [s for s in range(51) if training.is_checkpoint_step(s)] == [0, 20, 40, 50]
    assert TrainingConfig(steps=40, refresh_every=20, warmup_steps=1).checkpoint_steps() == [
        0, 20, 40]
    cfg = parse_config({"data": {"path": "/d"}, "training": {"steps": 50, "refresh_every": 20,
                                                             "warmup_steps": 1}})
    need = run_store_bytes(cfg, docs=100, train_queries=10, eval_queries=0, dim=8,
                           model_params=1000)
    assert need.checkpoints == 4


def test_wise_ft_alpha_is_a_fraction_of_the_way_to_the_trained_weights() -> None:
    assert TrainingConfig().wise_ft_alpha == 1.0  # off: the trained weights are published
    assert TrainingConfig(wise_ft_alpha=0.5).wise_ft_alpha == 0.5
    assert TrainingConfig(wise_ft_alpha="auto").wise_ft_alpha == "auto"
    for bad in (0.0, -0.1, 1.5, "half"):
        with pytest.raises(ValidationError, match="wise_ft_alpha"):
            TrainingConfig(wise_ft_alpha=bad)
