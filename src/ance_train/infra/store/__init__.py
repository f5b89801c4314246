"""Object store shared by the Trainer, Inferencer and Indexer.

Two backends expose the same keys:

* :class:`S3Store` talks the S3 API through the ``minio`` client (one bucket).
* :class:`LocalStore` keeps objects in a local directory (embedded mode).

Every store is bound to one run: public methods take keys *relative* to the run
(``"checkpoints/100/config.json"``) and the store prefixes ``<run_id>/``.  Keys are
validated so that they can never escape the run's prefix.

Integrity: every object carries its sha256 (S3 user metadata ``x-amz-meta-sha256``,
or a ``<key>.sha256`` sidecar file for the local backend, written after the data).
Reads verify it and raise :class:`CorruptObject` on mismatch, so a truncated or
corrupt object is never used (:meth:`ObjectStore.open_verified` streams one into the
caller's buffers and verifies it as it is read: :mod:`.verified`).  Directories are
uploaded with :meth:`ObjectStore.put_dir`, which writes ``MANIFEST.json`` last;
:meth:`ObjectStore.get_dir` refuses a prefix without a manifest.

The package is split by backend: :mod:`.base` (the interface, errors, key validation and
checksum helpers), :mod:`.local` and :mod:`.s3`; this module re-exports the public names and
builds the run's store from the environment (:func:`store_from_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ance_train.infra.env import env_flag
from ance_train.infra.store.base import _TMP_MARKER as _TMP_MARKER  # temp-file names (tests)
from ance_train.infra.store.base import (
    MANIFEST_NAME,
    CorruptObject,
    InvalidKey,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    validate_key,
)
from ance_train.infra.store.local import LocalStore
from ance_train.infra.store.s3 import S3Client, S3Reader, S3Store

__all__ = [
    "MANIFEST_NAME",
    "CorruptObject",
    "InvalidKey",
    "LocalStore",
    "ObjectNotFound",
    "ObjectStore",
    "S3Client",
    "S3Reader",
    "S3Store",
    "StorageError",
    "s3_client_from_env",
    "store_from_env",
    "validate_key",
]


def s3_client_from_env(env: Mapping[str, str] = os.environ) -> S3Client | None:
    """The S3 client of the run's settings, or ``None`` when ``ANCE_S3_ENDPOINT`` is unset:
    ``ANCE_S3_ENDPOINT``, ``ANCE_S3_ACCESS_KEY``, ``ANCE_S3_SECRET_KEY`` (both required),
    ``ANCE_S3_SECURE`` (``0``/``1``, default 0), and the optional ``ANCE_S3_REGION`` and
    ``ANCE_S3_RETRY_SECONDS``. The run's store and an ``s3://`` dataset both use it."""
    endpoint = env.get("ANCE_S3_ENDPOINT", "").strip()
    if not endpoint:
        return None
    missing = [v for v in ("ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY") if not env.get(v)]
    if missing:
        raise StorageError(
            f"ANCE_S3_ENDPOINT is set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing"
        )
    secure = env_flag("ANCE_S3_SECURE", env, StorageError)
    retry_raw = env.get("ANCE_S3_RETRY_SECONDS", "").strip()
    try:
        retry_seconds = float(retry_raw) if retry_raw else 60.0
    except ValueError as e:
        raise StorageError(f"ANCE_S3_RETRY_SECONDS must be a number, got {retry_raw!r}") from e
    return S3Client(
        endpoint,
        env["ANCE_S3_ACCESS_KEY"],
        env["ANCE_S3_SECRET_KEY"],
        secure=secure,
        region=s3_region(env),
        retry_seconds=retry_seconds,
    )


def s3_region(env: Mapping[str, str] = os.environ) -> str | None:
    return env.get("ANCE_S3_REGION", "").strip() or None


def store_from_env(run_id: str, local_root: str | None = None) -> ObjectStore:
    """Build the run's store from the environment.

    If ``ANCE_S3_ENDPOINT`` is set: :class:`S3Store` with the client of
    :func:`s3_client_from_env` and the bucket ``ANCE_S3_BUCKET`` (default ``ance-train``).
    Otherwise :class:`LocalStore` at ``local_root`` or ``ANCE_STORE_DIR``.
    """
    env = os.environ
    client = s3_client_from_env(env)
    if client is not None:
        return S3Store(
            run_id,
            env["ANCE_S3_ENDPOINT"].strip(),
            env["ANCE_S3_ACCESS_KEY"],
            env["ANCE_S3_SECRET_KEY"],
            env.get("ANCE_S3_BUCKET", "").strip() or "ance-train",
            secure=client.secure,
            region=s3_region(env),
            retry_seconds=client.retry_seconds,
        )
    root = local_root or env.get("ANCE_STORE_DIR", "").strip()
    if not root:
        raise StorageError(
            "no object store configured: set ANCE_S3_ENDPOINT (with ANCE_S3_ACCESS_KEY and "
            "ANCE_S3_SECRET_KEY) for S3, or ANCE_STORE_DIR / local_root for a local directory"
        )
    return LocalStore(run_id, root)
