"""The one parser of boolean environment flags (src/ance_train/infra/env.py) and its two users:
``ANCE_CLUSTER_MODE`` (credentials) and ``ANCE_S3_SECURE`` (store_from_env)."""

from __future__ import annotations

import pytest

from ance_train.infra.credentials import CredentialsError, cluster_mode
from ance_train.infra.env import env_flag
from ance_train.infra.store import StorageError, store_from_env

TRUE = ["1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " 1 ", "true\n"]
FALSE = ["", "  ", "0", "false", "FALSE", "no", "No", "off", "Off", " 0\t"]
REJECTED = ["maybe", "2", "-1", "y", "n", "t", "f", "enabled", "1.0", "on off", "ja"]


@pytest.mark.parametrize("raw", TRUE)
def test_true_spellings(raw: str) -> None:
    assert env_flag("ANCE_FLAG", {"ANCE_FLAG": raw}) is True


@pytest.mark.parametrize("raw", FALSE)
def test_false_spellings(raw: str) -> None:
    assert env_flag("ANCE_FLAG", {"ANCE_FLAG": raw}) is False


def test_unset_is_false() -> None:
    assert env_flag("ANCE_FLAG", {}) is False
    assert env_flag("ANCE_FLAG", {"OTHER": "1"}) is False


@pytest.mark.parametrize("raw", REJECTED)
def test_other_values_are_rejected_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=r"^ANCE_FLAG must be 0 or 1, got ") as info:
        env_flag("ANCE_FLAG", {"ANCE_FLAG": raw})
    assert repr(raw.strip().lower()) in str(info.value)


def test_the_callers_error_type_is_raised() -> None:
    class SettingError(RuntimeError):
        pass

    with pytest.raises(SettingError, match="ANCE_FLAG"):
        env_flag("ANCE_FLAG", {"ANCE_FLAG": "maybe"}, SettingError)


@pytest.mark.parametrize(("raw", "expected"), [("yes", True), ("off", False), ("", False)])
def test_cluster_mode_uses_the_parser(raw: str, expected: bool) -> None:
    assert cluster_mode({"ANCE_CLUSTER_MODE": raw}) is expected


def test_cluster_mode_rejects_with_its_own_error() -> None:
    with pytest.raises(CredentialsError, match="ANCE_CLUSTER_MODE must be 0 or 1, got 'maybe'"):
        cluster_mode({"ANCE_CLUSTER_MODE": "Maybe"})


def test_s3_secure_rejects_with_a_storage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANCE_S3_ENDPOINT", "127.0.0.1:1")
    monkeypatch.setenv("ANCE_S3_ACCESS_KEY", "AKID")
    monkeypatch.setenv("ANCE_S3_SECRET_KEY", "secret-key")
    monkeypatch.setenv("ANCE_S3_SECURE", "sometimes")
    with pytest.raises(StorageError, match="ANCE_S3_SECURE must be 0 or 1, got 'sometimes'"):
        store_from_env("r")
