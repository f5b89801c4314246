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
corrupt object is never used.  Directories are uploaded with :meth:`ObjectStore.put_dir`,
which writes ``MANIFEST.json`` last; :meth:`ObjectStore.get_dir` refuses a prefix
without a manifest.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import certifi
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import check_bucket_name
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_before_delay,
    wait_exponential,
)

__all__ = [
    "MANIFEST_NAME",
    "CorruptObject",
    "InvalidKey",
    "LocalStore",
    "ObjectNotFound",
    "ObjectStore",
    "S3Store",
    "StorageError",
    "store_from_env",
    "validate_key",
]

from ance_train.infra.atomic import atomic_write

log = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
SIDECAR_SUFFIX = ".sha256"
_TMP_MARKER = ".ance-tmp"
_CHUNK = 1 << 20
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_META_SHA = "x-amz-meta-sha256"

T = TypeVar("T")


class StorageError(Exception):
    """Base error of the object store."""


class ObjectNotFound(StorageError):
    """The object does not exist (or is not completely written yet)."""


class CorruptObject(StorageError):
    """The object's bytes do not match its recorded checksum (or it has none)."""


class InvalidKey(StorageError, ValueError):
    """The key (or run id) is malformed or would escape the run's prefix."""


# --------------------------------------------------------------------------- helpers


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid run-relative key, else raise :class:`InvalidKey`.

    Rejected: empty keys, absolute keys, backslashes, control characters, empty, ``.``
    or ``..`` segments, names reserved for checksum sidecars (``*.sha256``) and temp files.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"invalid key {key!r}: must be a non-empty string")
    if key.startswith("/"):
        raise InvalidKey(f"invalid key {key!r}: must be relative to the run")
    if "\\" in key:
        raise InvalidKey(f"invalid key {key!r}: backslashes are not allowed")
    if any(ord(c) < 0x20 or c == "\x7f" for c in key):
        raise InvalidKey(f"invalid key {key!r}: control characters are not allowed")
    segments = key.split("/")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise InvalidKey(f"invalid key {key!r}: empty, '.' and '..' segments are not allowed")
        if _TMP_MARKER in seg:
            raise InvalidKey(f"invalid key {key!r}: {_TMP_MARKER!r} is reserved for temp files")
    if segments[-1].endswith(SIDECAR_SUFFIX):
        raise InvalidKey(f"invalid key {key!r}: the suffix {SIDECAR_SUFFIX!r} is reserved")
    return key


def _validate_prefix(prefix: str) -> str:
    """Normalise a directory-like prefix: ``""`` (whole run) or a valid key, no trailing /."""
    if not isinstance(prefix, str):
        raise InvalidKey(f"invalid prefix {prefix!r}: must be a string")
    if prefix.endswith("/"):
        prefix = prefix[:-1]
        if not prefix:
            raise InvalidKey("invalid prefix '/': must be relative to the run")
    return validate_key(prefix) if prefix else ""


def _validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or run_id in (".", ".."):
        raise InvalidKey(
            f"invalid run id {run_id!r}: use letters, digits, '.', '_', '-', '=' "
            "(at most 200 characters, not starting with a punctuation character)"
        )
    if _TMP_MARKER in run_id or run_id.endswith(SIDECAR_SUFFIX):
        raise InvalidKey(f"invalid run id {run_id!r}: reserved name")
    return run_id


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def _hash_file(path: Path) -> tuple[str, int]:
    """Return (sha256 hex, size) of a local file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _verify(key: str, expected: str | None, actual: str) -> None:
    if expected is None or not _SHA_RE.match(expected.strip().lower()):
        raise CorruptObject(f"object {key!r} has no valid sha256 checksum recorded")
    if expected.strip().lower() != actual:
        raise CorruptObject(
            f"object {key!r} is corrupt: sha256 {actual} does not match recorded {expected}"
        )


def _fsync_dir(path: Path) -> None:
    """Best-effort fsync of a directory so that renames inside it are durable."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- base class


class ObjectStore(abc.ABC):
    """Object store bound to one run; all keys are relative to ``<run_id>/``."""

    def __init__(self, run_id: str) -> None:
        self._run_id = _validate_run_id(run_id)

    @property
    def run_id(self) -> str:
        """The run this store is bound to."""
        return self._run_id

    def full_key(self, key: str) -> str:
        """Validate ``key`` and return it with the run prefix (``<run_id>/<key>``)."""
        return f"{self._run_id}/{validate_key(key)}"

    # ---- backend primitives

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key`` (atomically, with its checksum); return its sha256."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the object's bytes after verifying its sha256 (CorruptObject on mismatch)."""

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        """Upload a local file under ``key``; return its sha256."""

    @abc.abstractmethod
    def _download_to(self, key: str, f: IO[bytes]) -> str:
        """Write the object into ``f`` (from its start), verify it, return its sha256."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a completely written object exists under ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted run-relative keys of all objects under the directory-like ``prefix``.

        ``prefix`` is a key path (``"checkpoints/100"`` lists ``checkpoints/100/...`` but
        not ``checkpoints/1000/...``); ``""`` lists the whole run.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object (no error if it does not exist)."""

    # ---- derived operations

    def get_file(self, key: str, path: str | os.PathLike[str]) -> str:
        """Download the object to ``path`` (temp file + ``os.replace``); return its sha256.

        ``path`` is only replaced once the checksum has been verified.
        """
        return self._get_file_checked(key, Path(path), None)

    def _get_file_checked(self, key: str, path: Path, expected: str | None) -> str:
        validate_key(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_MARKER)
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w+b") as f:
                sha = self._download_to(key, f)
                f.flush()
                os.fsync(f.fileno())
            if expected is not None and sha != expected:
                raise CorruptObject(
                    f"object {key!r} has sha256 {sha} but the manifest records {expected}"
                )
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return sha

    def put_json(self, key: str, obj: Any) -> str:
        """Store ``obj`` as UTF-8 JSON; return its sha256."""
        data = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode("utf-8")
        return self.put_bytes(key, data)

    def get_json(self, key: str) -> Any:
        """Load a JSON object (checksum verified; undecodable JSON → CorruptObject)."""
        data = self.get_bytes(key)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptObject(f"object {key!r} is not valid JSON: {e}") from e

    def put_dir(self, prefix: str, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Upload every file under ``directory`` (recursively) to ``<prefix>/<relative path>``.

        ``<prefix>/MANIFEST.json`` (``{"version": 1, "files": {rel: {"sha256", "size"}}}``)
        is deleted first and written last, so a reader never sees a half-uploaded
        directory as complete.  Returns the manifest.
        """
        prefix = _validate_prefix(prefix)
        root = Path(directory)
        if not root.is_dir():
            raise StorageError(f"put_dir: {str(root)!r} is not a directory")
        rels: list[tuple[str, Path]] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                p = Path(dirpath, name)
                if not p.is_file():
                    continue
                rel = p.relative_to(root).as_posix()
                validate_key(rel)
                if rel == MANIFEST_NAME:
                    raise StorageError(
                        f"put_dir: {str(root)!r} contains {MANIFEST_NAME}, a reserved name"
                    )
                rels.append((rel, p))
        rels.sort()
        manifest_key = _join(prefix, MANIFEST_NAME)
        self.delete(manifest_key)
        files: dict[str, dict[str, Any]] = {}
        for rel, p in rels:
            sha = self.put_file(_join(prefix, rel), p)
            files[rel] = {"sha256": sha, "size": p.stat().st_size}
        manifest = {"version": 1, "files": files}
        self.put_json(manifest_key, manifest)
        return manifest

    def get_dir(self, prefix: str, directory: str | os.PathLike[str],
                skip: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Download a directory written by :meth:`put_dir` into ``directory``.

        Requires ``<prefix>/MANIFEST.json`` (ObjectNotFound otherwise); every file is
        verified against its own checksum and against the manifest.  Files whose relative
        path ``skip`` accepts are not downloaded (an inferencer needs no optimizer state).
        Returns the manifest.
        """
        prefix = _validate_prefix(prefix)
        manifest_key = _join(prefix, MANIFEST_NAME)
        manifest = self.get_json(manifest_key)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            raise CorruptObject(f"manifest {manifest_key!r} has no 'files' mapping")
        dest = Path(directory)
        dest.mkdir(parents=True, exist_ok=True)
        for rel, info in sorted(files.items()):
            try:
                validate_key(rel)
            except InvalidKey as e:
                raise CorruptObject(f"manifest {manifest_key!r} lists a bad path: {e}") from e
            if (
                not isinstance(info, dict)
                or not isinstance(info.get("sha256"), str)
                or not isinstance(info.get("size"), int)
            ):
                raise CorruptObject(f"manifest {manifest_key!r} has a bad entry for {rel!r}")
            if skip is not None and skip(rel):
                continue
            target = dest / rel
            self._get_file_checked(_join(prefix, rel), target, info["sha256"])
            if target.stat().st_size != info["size"]:
                raise CorruptObject(
                    f"object {_join(prefix, rel)!r} has size {target.stat().st_size} "
                    f"but the manifest records {info['size']}"
                )
        return manifest


# --------------------------------------------------------------------------- local backend


class LocalStore(ObjectStore):
    """Objects as files under ``root/<run_id>/<key>`` with a ``<key>.sha256`` sidecar.

    The sidecar is written after the data (both via temp file + fsync + ``os.replace``);
    a data file without a sidecar is an incomplete write and is treated as absent.
    """

    def __init__(self, run_id: str, root: str | os.PathLike[str]) -> None:
        super().__init__(run_id)
        self._root = Path(root).absolute()
        self._run_dir = self._root / self._run_id

    @property
    def root(self) -> Path:
        """The store's root directory (shared by all runs)."""
        return self._root

    def __repr__(self) -> str:
        return f"LocalStore(run_id={self._run_id!r}, root={str(self._root)!r})"

    def _path(self, key: str) -> Path:
        return self._run_dir / validate_key(key)

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_name(path.name + SIDECAR_SUFFIX)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError as e:
            raise ObjectNotFound(f"object {key!r} not found in run {self._run_id!r}") from e
        except OSError as e:
            raise StorageError(f"{op} {key!r} failed: {e}") from e

    def _commit(self, key: str, sha: str, write_data: Callable[[IO[bytes]], Any]) -> None:
        path = self._path(key)
        sidecar = self._sidecar(path)
        with self._errors("put", key):
            # Drop the old checksum first: while the data is replaced the object is absent.
            sidecar.unlink(missing_ok=True)
            atomic_write(path, write_data, suffix=_TMP_MARKER)
            atomic_write(sidecar, lambda f: f.write(sha.encode("ascii") + b"\n"),
                         suffix=_TMP_MARKER)
            _fsync_dir(path.parent)

    def put_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key``; return its sha256."""
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self._commit(key, sha, lambda f: f.write(data))
        return sha

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        """Copy a local file into the store (hashing while copying); return its sha256."""
        validate_key(key)
        h = hashlib.sha256()
        with open(path, "rb") as src:

            def copy(f: IO[bytes]) -> None:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    f.write(chunk)

            # sha is known only after copying: write data, then the sidecar.
            dst = self._path(key)
            sidecar = self._sidecar(dst)
            with self._errors("put", key):
                sidecar.unlink(missing_ok=True)
                atomic_write(dst, copy, suffix=_TMP_MARKER)
                sha = h.hexdigest()
                atomic_write(sidecar, lambda f: f.write(sha.encode("ascii") + b"\n"),
                         suffix=_TMP_MARKER)
                _fsync_dir(dst.parent)
        return sha

    def _read_sidecar(self, key: str, path: Path) -> str:
        with self._errors("get", key):
            text = self._sidecar(path).read_text(encoding="ascii", errors="replace").strip()
        return text

    def get_bytes(self, key: str) -> bytes:
        """Return the object's bytes (sha256 verified)."""
        path = self._path(key)
        expected = self._read_sidecar(key, path)
        with self._errors("get", key):
            data = path.read_bytes()
        _verify(key, expected, hashlib.sha256(data).hexdigest())
        return data

    def _download_to(self, key: str, f: IO[bytes]) -> str:
        path = self._path(key)
        expected = self._read_sidecar(key, path)
        h = hashlib.sha256()
        with self._errors("get", key), open(path, "rb") as src:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
        sha = h.hexdigest()
        _verify(key, expected, sha)
        return sha

    def exists(self, key: str) -> bool:
        """Whether the object and its checksum sidecar both exist."""
        path = self._path(key)
        return path.is_file() and self._sidecar(path).is_file()

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` (sidecars, temp files and incomplete objects skipped)."""
        prefix = _validate_prefix(prefix)
        base = self._run_dir / prefix if prefix else self._run_dir
        if not base.is_dir():
            return []
        keys: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(base):
            names = set(filenames)
            for name in filenames:
                if name.endswith(SIDECAR_SUFFIX) or _TMP_MARKER in name:
                    continue
                if name + SIDECAR_SUFFIX not in names:
                    continue  # incomplete write
                rel = Path(dirpath, name).relative_to(self._run_dir).as_posix()
                keys.append(rel)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove the sidecar (the object disappears), then the data file."""
        path = self._path(key)
        with self._errors("delete", key):
            self._sidecar(path).unlink(missing_ok=True)
            if path.is_file() or path.is_symlink():
                path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- S3 backend

_TRANSIENT_S3_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "ServerBusy"}
)
_NOT_FOUND_S3_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "ResourceNotFound", "NoSuchObject"})


def _is_transient(exc: BaseException) -> bool:
    """Connection-level or 5xx failures are retried; not-found/checksum/auth errors are not."""
    if isinstance(exc, StorageError):
        return False
    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", 0) or 0
        return exc.code in _TRANSIENT_S3_CODES or status >= 500
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, InvalidResponseError):
        status = getattr(exc, "_code", 0)
        return isinstance(status, int) and status >= 500
    if isinstance(exc, urllib3.exceptions.SSLError):
        return False
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        return not isinstance(exc.reason, urllib3.exceptions.SSLError)
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


class S3Store(ObjectStore):
    """Objects in an S3 bucket (via ``minio``) under ``<run_id>/<key>``.

    The sha256 is stored as user metadata (``x-amz-meta-sha256``) and verified on read.
    S3 PUTs are atomic, so an object is only ever visible complete.  Network calls are
    retried with exponential backoff for up to ``retry_seconds`` on connection errors and
    5xx responses; the result is then :class:`StorageError`.
    """

    def __init__(
        self,
        run_id: str,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        *,
        secure: bool = False,
        region: str | None = None,
        retry_seconds: float = 60.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        create_bucket: bool = True,
    ) -> None:
        super().__init__(run_id)
        if "://" in endpoint:  # tolerate "http://host:port" / "https://host:port"
            scheme, _, endpoint = endpoint.partition("://")
            secure = scheme.lower() == "https"
        endpoint = endpoint.rstrip("/")
        if not endpoint or "/" in endpoint:
            raise StorageError(f"invalid S3 endpoint {endpoint!r}: expected host[:port]")
        try:
            check_bucket_name(bucket)
        except ValueError as e:
            raise StorageError(f"invalid S3 bucket name {bucket!r}: {e}") from e
        self._endpoint = endpoint
        self._secure = secure
        self._bucket = bucket
        self._retry_seconds = float(retry_seconds)
        # Retries are done here (tenacity), not inside urllib3; redirects are left to minio.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            maxsize=16,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(total=0, redirect=False),
        )
        try:
            self._client = Minio(
                endpoint,
                access_key=access_key,
                secret_key=secret_key,
                secure=secure,
                region=region,
                http_client=http,
            )
        except ValueError as e:
            raise StorageError(f"invalid S3 endpoint {endpoint!r}: {e}") from e
        if create_bucket:
            self._ensure_bucket(region)

    def __repr__(self) -> str:
        scheme = "https" if self._secure else "http"
        return (
            f"S3Store(run_id={self._run_id!r}, endpoint='{scheme}://{self._endpoint}', "
            f"bucket={self._bucket!r})"
        )

    @property
    def bucket(self) -> str:
        """The bucket holding all runs."""
        return self._bucket

    @property
    def client(self) -> Minio:
        """The underlying minio client (for tests and administration)."""
        return self._client

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries on transient errors; map errors to StorageError types."""

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "S3 %s failed (attempt %d, %s: %s); retrying",
                what,
                state.attempt_number,
                type(exc).__name__,
                exc,
            )

        retryer = Retrying(
            stop=stop_before_delay(self._retry_seconds),
            wait=wait_exponential(multiplier=0.25, max=8.0),
            retry=retry_if_exception(_is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retryer(fn)
        except StorageError:
            raise
        except S3Error as e:
            if e.code in _NOT_FOUND_S3_CODES:
                raise ObjectNotFound(f"{what}: not found ({e.code})") from e
            raise StorageError(f"S3 {what} failed: {e.code}: {e.message}") from e
        except (MinioException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as e:
            raise StorageError(
                f"S3 {what} failed (endpoint {self._endpoint}, retried for up to "
                f"{self._retry_seconds:g}s): {type(e).__name__}: {e}"
            ) from e

    def _ensure_bucket(self, region: str | None) -> None:
        def op() -> None:
            if self._client.bucket_exists(self._bucket):
                return
            try:
                if region:
                    self._client.make_bucket(self._bucket, location=region)
                else:
                    self._client.make_bucket(self._bucket)
            except S3Error as e:
                if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._call(f"create bucket {self._bucket!r}", op)

    def put_bytes(self, key: str, data: bytes) -> str:
        """Upload ``data`` with its sha256 in the metadata; return the sha256."""
        name = self.full_key(key)
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self._call(
            f"put {name!r}",
            lambda: self._client.put_object(
                self._bucket,
                name,
                io.BytesIO(data),
                len(data),
                content_type="application/octet-stream",
                metadata={"sha256": sha},
            ),
        )
        return sha

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        """Upload a local file with its sha256 in the metadata; return the sha256."""
        name = self.full_key(key)
        src = Path(path)
        sha, size = _hash_file(src)

        def op() -> None:
            with open(src, "rb") as f:  # reopened per attempt: retries restart the stream
                self._client.put_object(
                    self._bucket,
                    name,
                    f,
                    size,
                    content_type="application/octet-stream",
                    metadata={"sha256": sha},
                )

        self._call(f"put {name!r}", op)
        return sha

    def _fetch(self, name: str, sink: IO[bytes]) -> tuple[str | None, str]:
        """GET ``name`` into ``sink`` (restarting it per attempt); return (recorded, actual)."""

        def op() -> tuple[str | None, str]:
            sink.seek(0)
            sink.truncate()
            resp = self._client.get_object(self._bucket, name)
            try:
                recorded = resp.headers.get(_META_SHA)
                h = hashlib.sha256()
                for chunk in resp.stream(_CHUNK):
                    h.update(chunk)
                    sink.write(chunk)
            finally:
                resp.close()
                resp.release_conn()
            return recorded, h.hexdigest()

        return self._call(f"get {name!r}", op)

    def get_bytes(self, key: str) -> bytes:
        """Download the object and verify its sha256."""
        name = self.full_key(key)
        buf = io.BytesIO()
        recorded, actual = self._fetch(name, buf)
        _verify(key, recorded, actual)
        return buf.getvalue()

    def _download_to(self, key: str, f: IO[bytes]) -> str:
        recorded, actual = self._fetch(self.full_key(key), f)
        _verify(key, recorded, actual)
        return actual

    def exists(self, key: str) -> bool:
        """Whether the object exists (HEAD)."""
        name = self.full_key(key)
        try:
            self._call(f"stat {name!r}", lambda: self._client.stat_object(self._bucket, name))
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        """Sorted run-relative keys under ``prefix`` (recursive)."""
        prefix = _validate_prefix(prefix)
        base = f"{self._run_id}/{prefix}/" if prefix else f"{self._run_id}/"

        def op() -> list[str]:
            out = []
            for obj in self._client.list_objects(self._bucket, prefix=base, recursive=True):
                name = obj.object_name or ""
                if name.startswith(base) and not name.endswith("/"):
                    out.append(name[len(self._run_id) + 1 :])
            return out

        try:
            return sorted(self._call(f"list {base!r}", op))
        except ObjectNotFound:
            return []

    def delete(self, key: str) -> None:
        """Delete the object (S3 DELETE is idempotent)."""
        name = self.full_key(key)
        self._call(f"delete {name!r}", lambda: self._client.remove_object(self._bucket, name))


# --------------------------------------------------------------------------- factory

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def store_from_env(run_id: str, local_root: str | None = None) -> ObjectStore:
    """Build the run's store from the environment.

    If ``ANCE_S3_ENDPOINT`` is set: :class:`S3Store` from ``ANCE_S3_ENDPOINT``,
    ``ANCE_S3_ACCESS_KEY``, ``ANCE_S3_SECRET_KEY`` (both required), ``ANCE_S3_BUCKET``
    (default ``ance-train``), ``ANCE_S3_SECURE`` (``0``/``1``, default 0), and the optional
    ``ANCE_S3_REGION`` and ``ANCE_S3_RETRY_SECONDS``.  Otherwise :class:`LocalStore` at
    ``local_root`` or ``ANCE_STORE_DIR``.
    """
    env = os.environ
    endpoint = env.get("ANCE_S3_ENDPOINT", "").strip()
    if endpoint:
        missing = [v for v in ("ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY") if not env.get(v)]
        if missing:
            raise StorageError(
                f"ANCE_S3_ENDPOINT is set but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing"
            )
        secure_raw = env.get("ANCE_S3_SECURE", "0").strip().lower()
        if secure_raw not in _TRUE | _FALSE:
            raise StorageError(f"ANCE_S3_SECURE must be 0 or 1, got {secure_raw!r}")
        retry_raw = env.get("ANCE_S3_RETRY_SECONDS", "").strip()
        try:
            retry_seconds = float(retry_raw) if retry_raw else 60.0
        except ValueError as e:
            raise StorageError(f"ANCE_S3_RETRY_SECONDS must be a number, got {retry_raw!r}") from e
        return S3Store(
            run_id,
            endpoint,
            env["ANCE_S3_ACCESS_KEY"],
            env["ANCE_S3_SECRET_KEY"],
            env.get("ANCE_S3_BUCKET", "").strip() or "ance-train",
            secure=secure_raw in _TRUE,
            region=env.get("ANCE_S3_REGION", "").strip() or None,
            retry_seconds=retry_seconds,
        )
    root = local_root or env.get("ANCE_STORE_DIR", "").strip()
    if not root:
        raise StorageError(
            "no object store configured: set ANCE_S3_ENDPOINT (with ANCE_S3_ACCESS_KEY and "
            "ANCE_S3_SECRET_KEY) for S3, or ANCE_STORE_DIR / local_root for a local directory"
        )
    return LocalStore(run_id, root)
