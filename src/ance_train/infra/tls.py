"""Encrypted and authenticated traffic: TLS for gRPC and for Redis, and Redis's ACL user.

Like the other credentials (:mod:`ance_train.infra.credentials`) these settings come from the
environment and from files (a Kubernetes Secret mounted in the pod), never from the run
config. Off by default: the embedded launcher talks plaintext on loopback.

gRPC (every server and channel is made in :mod:`ance_train.infra.rpc`):

- ``ANCE_GRPC_TLS=1`` turns TLS on for every server and client of the process.
- ``ANCE_GRPC_TLS_CERT`` / ``ANCE_GRPC_TLS_KEY``: this service's certificate chain and key
  (PEM). A server needs them; with mutual TLS a client presents them too.
- ``ANCE_GRPC_TLS_CA``: the CA bundle that verifies the peer (a server's certificate; with
  mutual TLS also the client's).
- ``ANCE_GRPC_TLS_MUTUAL=1``: servers require a client certificate signed by that CA.
- ``ANCE_GRPC_TLS_SERVER_NAME``: the name checked in the server's certificate when it is not
  the host dialled (services advertise pod IPs; the certificate names the service).

Redis (the client is made in :func:`ance_train.infra.bus.connect`):

- a ``rediss://`` URL turns TLS on; ``ANCE_REDIS_TLS_CA`` verifies the server (the system's
  CAs when unset), ``ANCE_REDIS_TLS_CERT`` / ``ANCE_REDIS_TLS_KEY`` are the client certificate
  when the server asks for one (``tls-auth-clients yes``);
- ``ANCE_REDIS_USERNAME``: the ACL user (password: ``ANCE_REDIS_PASSWORD``), whose rule of
  least privilege is :func:`redis_acl_rule`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ance_train.infra.env import env_flag

GRPC_TLS_VAR = "ANCE_GRPC_TLS"
GRPC_TLS_CERT_VAR = "ANCE_GRPC_TLS_CERT"
GRPC_TLS_KEY_VAR = "ANCE_GRPC_TLS_KEY"
GRPC_TLS_CA_VAR = "ANCE_GRPC_TLS_CA"
GRPC_TLS_MUTUAL_VAR = "ANCE_GRPC_TLS_MUTUAL"
GRPC_TLS_SERVER_NAME_VAR = "ANCE_GRPC_TLS_SERVER_NAME"
REDIS_USERNAME_VAR = "ANCE_REDIS_USERNAME"
REDIS_TLS_CA_VAR = "ANCE_REDIS_TLS_CA"
REDIS_TLS_CERT_VAR = "ANCE_REDIS_TLS_CERT"
REDIS_TLS_KEY_VAR = "ANCE_REDIS_TLS_KEY"


class TlsConfigError(ValueError):
    """A TLS setting is missing, or names a file that cannot be read."""


def _read(var: str, env: Mapping[str, str], required_for: str | None) -> bytes | None:
    """The PEM file named by ``var``; None when unset (an error when ``required_for``)."""
    path = env.get(var, "").strip()
    if not path:
        if required_for:
            raise TlsConfigError(f"{var} is required {required_for}")
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TlsConfigError(f"{var}={path}: cannot read the file ({error.strerror})") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{var}={path}: not a PEM file (no -----BEGIN line)")
    return data


class GrpcTls(BaseModel):
    """The PEM material of one process's gRPC TLS (read once, when a server/channel is made)."""

    model_config = ConfigDict(frozen=True)

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    mutual: bool = False
    server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> GrpcTls | None:
        """The settings of ``ANCE_GRPC_TLS*``; None when ``ANCE_GRPC_TLS`` is off."""
        if not env_flag(GRPC_TLS_VAR, env, TlsConfigError):
            return None
        mutual = env_flag(GRPC_TLS_MUTUAL_VAR, env, TlsConfigError)
        why = f"with {GRPC_TLS_VAR}=1"
        ca = _read(GRPC_TLS_CA_VAR, env, why)
        assert ca is not None
        cert = _read(GRPC_TLS_CERT_VAR, env, f"with {GRPC_TLS_MUTUAL_VAR}=1" if mutual else None)
        key = _read(GRPC_TLS_KEY_VAR, env, f"with {GRPC_TLS_CERT_VAR} set" if cert else None)
        if key and not cert:
            raise TlsConfigError(f"{GRPC_TLS_KEY_VAR} is set without {GRPC_TLS_CERT_VAR}")
        return cls(ca=ca, cert=cert, key=key, mutual=mutual,
                   server_name=env.get(GRPC_TLS_SERVER_NAME_VAR, "").strip() or None)

    def server_credentials(self) -> Any:
        """Credentials of a server: its certificate; with ``mutual``, client certificates
        signed by the CA are required."""
        import grpc

        if not (self.cert and self.key):
            raise TlsConfigError(f"a gRPC server with {GRPC_TLS_VAR}=1 needs "
                                 f"{GRPC_TLS_CERT_VAR} and {GRPC_TLS_KEY_VAR}")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca if self.mutual else None,
            require_client_auth=self.mutual)

    def channel_credentials(self) -> Any:
        """Credentials of a client: the CA; with ``mutual``, this service's certificate."""
        import grpc

        if self.mutual:
            return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        return grpc.ssl_channel_credentials(self.ca)

    def channel_options(self) -> list[tuple[str, str]]:
        return ([("grpc.ssl_target_name_override", self.server_name)] if self.server_name
                else [])


def redis_client_options(url: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """redis-py keyword arguments for the ACL user and, for a ``rediss://`` URL, TLS."""
    options: dict[str, Any] = {}
    username = env.get(REDIS_USERNAME_VAR, "").strip()
    if username:
        options["username"] = username
    tls_vars = [var for var in (REDIS_TLS_CA_VAR, REDIS_TLS_CERT_VAR, REDIS_TLS_KEY_VAR)
                if env.get(var, "").strip()]
    if not url.startswith("rediss://"):
        if tls_vars:
            raise TlsConfigError(f"{', '.join(tls_vars)} set but the Redis URL is not "
                                 f"rediss:// (TLS): use rediss://host:port/db")
        return options
    for var, option in ((REDIS_TLS_CA_VAR, "ssl_ca_certs"), (REDIS_TLS_CERT_VAR, "ssl_certfile"),
                        (REDIS_TLS_KEY_VAR, "ssl_keyfile")):
        if _read(var, env, None) is not None:  # checked here: a clear error before connecting
            options[option] = env[var].strip()
    if ("ssl_certfile" in options) != ("ssl_keyfile" in options):
        raise TlsConfigError(f"{REDIS_TLS_CERT_VAR} and {REDIS_TLS_KEY_VAR} go together")
    options["ssl_cert_reqs"] = "required"
    return options


# -- the Redis ACL user of least privilege ---------------------------------------------------
# Every command the services, the launcher and the CLI send (grep the code for ``client.``):
# events and the work queue (Streams + consumer groups), plain keys, the inferencer's Lua
# marker (EVALSHA, and SCRIPT LOAD on NOSCRIPT: redis-py never sends EVAL for it; the GET/SET
# the script runs are checked against the same rule), and what redis-py sends
# on a connection (AUTH and HELLO are always allowed; PING is its health check; CLIENT
# SETINFO, whose refusal it ignores, is not granted). A new command in the code is refused
# for this user until it is added here (tests/test_tls.py runs the bus as this user).
REDIS_ACL_COMMANDS: tuple[str, ...] = (
    "ping", "get", "set", "scan", "multi", "exec",
    "xadd", "xread", "xrange", "xrevrange", "xreadgroup", "xack", "xautoclaim", "xclaim",
    "xpending", "xgroup|create",
    "evalsha", "script|load",
)


def redis_key_pattern(run_id: str) -> str:
    """The keys of one run (every Redis key is ``ance:<run_id>:...``, protocol/keys.py)."""
    from ance_train.protocol.keys import redis_key

    return redis_key(run_id, "*")


def redis_acl_rule(run_id: str) -> list[str]:
    """The ACL rules (``ACL SETUSER <user> on ><password> <rules...>``) of the run's user: the
    run's keys and the commands in :data:`REDIS_ACL_COMMANDS`, nothing else (no pub/sub
    channels). The Helm chart's ``ance-train.redisAclRules`` writes the same list (a test
    compares them)."""
    return ["resetkeys", "resetchannels", "-@all", f"~{redis_key_pattern(run_id)}",
            *[f"+{command}" for command in REDIS_ACL_COMMANDS]]
