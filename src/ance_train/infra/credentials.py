"""Credentials from the environment: the Redis password, cluster-mode requirements, and keeping
secrets out of logs.

The Redis password comes from ``ANCE_REDIS_PASSWORD`` (never from a URL in cluster mode); the
S3 keys from ``ANCE_S3_ACCESS_KEY`` / ``ANCE_S3_SECRET_KEY`` (read by
:func:`ance_train.infra.store.store_from_env`). With ``ANCE_CLUSTER_MODE=1`` a process
refuses to start unless all of them, and ``ANCE_S3_ENDPOINT``, are set. Every log line goes
through :class:`RedactingFormatter`, which blanks the values of these variables and the
userinfo of any URL.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from ance_train.infra.env import env_flag

REDIS_PASSWORD_VAR = "ANCE_REDIS_PASSWORD"
CLUSTER_MODE_VAR = "ANCE_CLUSTER_MODE"
CLUSTER_REQUIRED_VARS = (REDIS_PASSWORD_VAR, "ANCE_S3_ENDPOINT", "ANCE_S3_ACCESS_KEY",
                         "ANCE_S3_SECRET_KEY")
SECRET_VARS = (REDIS_PASSWORD_VAR, "ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY")
REDACTED = "***"
# scheme://user:password@host  or  scheme://:password@host  or  scheme://token@host
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


class CredentialsError(RuntimeError):
    """A required credential is missing or a setting is malformed."""


def redis_password(env: Mapping[str, str] = os.environ) -> str | None:
    """The Redis AUTH password (``ANCE_REDIS_PASSWORD``), or None when unset/empty."""
    return env.get(REDIS_PASSWORD_VAR) or None


def cluster_mode(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``ANCE_CLUSTER_MODE`` is on (a boolean flag, see :func:`env_flag`)."""
    return env_flag(CLUSTER_MODE_VAR, env, CredentialsError)


def require_cluster_credentials(env: Mapping[str, str] = os.environ) -> None:
    """In cluster mode, fail unless every credential variable is set (naming each missing one)."""
    if not cluster_mode(env):
        return
    missing = [name for name in CLUSTER_REQUIRED_VARS if not env.get(name, "").strip()]
    if missing:
        raise CredentialsError(
            f"{CLUSTER_MODE_VAR}=1 requires credentials from the environment; missing: "
            f"{', '.join(missing)}")


def redact_url(url: str) -> str:
    """``redis://:pw@host:6379/0`` → ``redis://***@host:6379/0`` (any URL with userinfo)."""
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", url)


def redact(text: str, env: Mapping[str, str] = os.environ) -> str:
    """``text`` with URL userinfo and the values of the secret variables blanked."""
    text = redact_url(text)
    for name in SECRET_VARS:
        value = env.get(name, "")
        if len(value) >= 4:  # a one-letter "secret" would blank every occurrence of that letter
            text = text.replace(value, REDACTED)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose output (message, arguments and tracebacks) never carries a secret."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
