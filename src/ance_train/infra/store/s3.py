"""The S3 backend (through the ``minio`` client): one bucket, the sha256 in the object's user
metadata, and retries with exponential backoff on transient failures."""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

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

from ance_train.infra.store.base import (
    _CHUNK,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    _hash_file,
    _validate_prefix,
    _verify,
)

log = logging.getLogger(__name__)

_META_SHA = "x-amz-meta-sha256"

T = TypeVar("T")

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
