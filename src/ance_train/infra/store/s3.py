"""The S3 backend (through the ``minio`` client): one bucket, the sha256 in the object's user
metadata, and retries with exponential backoff on transient failures."""

from __future__ import annotations

import builtins
import functools
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


class S3Client:
    """The minio client of one endpoint and the retry policy every S3 call goes through.

    Network calls are retried with exponential backoff for up to ``retry_seconds`` on
    connection errors and 5xx responses; the result is then :class:`StorageError`
    (:class:`ObjectNotFound` for a missing object or bucket). Shared by :class:`S3Store`
    (the run's objects) and :class:`S3Reader` (a dataset in a bucket).
    """

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        *,
        secure: bool = False,
        region: str | None = None,
        retry_seconds: float = 60.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ) -> None:
        if "://" in endpoint:  # tolerate "http://host:port" / "https://host:port"
            scheme, _, endpoint = endpoint.partition("://")
            secure = scheme.lower() == "https"
        endpoint = endpoint.rstrip("/")
        if not endpoint or "/" in endpoint:
            raise StorageError(f"invalid S3 endpoint {endpoint!r}: expected host[:port]")
        self.endpoint = endpoint
        self.secure = secure
        self.retry_seconds = float(retry_seconds)
        # Retries are done here (tenacity), not inside urllib3; redirects are left to minio.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            maxsize=16,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(total=0, redirect=False),
        )
        try:
            self.minio = Minio(
                endpoint,
                access_key=access_key,
                secret_key=secret_key,
                secure=secure,
                region=region,
                http_client=http,
            )
        except ValueError as e:
            raise StorageError(f"invalid S3 endpoint {endpoint!r}: {e}") from e

    def call(self, what: str, fn: Callable[[], T]) -> T:
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
            stop=stop_before_delay(self.retry_seconds),
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
                f"S3 {what} failed (endpoint {self.endpoint}, retried for up to "
                f"{self.retry_seconds:g}s): {type(e).__name__}: {e}"
            ) from e


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
        try:
            check_bucket_name(bucket)
        except ValueError as e:
            raise StorageError(f"invalid S3 bucket name {bucket!r}: {e}") from e
        self._s3 = S3Client(endpoint, access_key, secret_key, secure=secure, region=region,
                            retry_seconds=retry_seconds, connect_timeout=connect_timeout,
                            read_timeout=read_timeout)
        self._endpoint = self._s3.endpoint
        self._secure = self._s3.secure
        self._bucket = bucket
        self._retry_seconds = self._s3.retry_seconds
        self._client = self._s3.minio
        self._call = self._s3.call
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

    def put_file(self, key: str, path: str | os.PathLike[str], share: bool = False) -> str:
        """Upload a local file with its sha256 in the metadata; return the sha256 (``share``
        changes nothing: the bytes always travel)."""
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
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Bytes of each object under ``prefix``, from the LIST replies (no HEAD per key)."""
        prefix = _validate_prefix(prefix)
        base = f"{self._run_id}/{prefix}/" if prefix else f"{self._run_id}/"

        def op() -> dict[str, int]:
            out = {}
            for obj in self._client.list_objects(self._bucket, prefix=base, recursive=True):
                name = obj.object_name or ""
                if name.startswith(base) and not name.endswith("/"):
                    out[name[len(self._run_id) + 1 :]] = int(obj.size or 0)
            return out

        try:
            return self._call(f"list {base!r}", op)
        except ObjectNotFound:
            return {}

    # builtins.list: in the class body ``list`` is the method above.
    def abort_unfinished_uploads(self) -> builtins.list[str]:
        """Abort the run's unfinished multipart uploads (minio uploads objects above its part
        size in parts; a writer killed or cut off between the first part and the last leaves
        the upload open, and ``minio`` cannot abort it then). Uses minio's ListMultipartUploads
        and AbortMultipartUpload calls, which it does not expose publicly (minio 7.2)."""
        base = f"{self._run_id}/"

        def op() -> list[tuple[str, str]]:
            found, key_marker, id_marker = [], None, None
            while True:
                page = self._client._list_multipart_uploads(  # private: see above
                    self._bucket, prefix=base, key_marker=key_marker,
                    upload_id_marker=id_marker)
                found += [(u.object_name, u.upload_id) for u in page.uploads
                          if u.object_name.startswith(base) and u.upload_id]
                if not page.is_truncated:
                    return found
                key_marker, id_marker = page.next_key_marker, page.next_upload_id_marker

        try:
            uploads = self._call(f"list unfinished uploads {base!r}", op)
        except ObjectNotFound:
            return []
        for name, upload_id in uploads:
            self._call(f"abort upload of {name!r}", functools.partial(
                self._client._abort_multipart_upload, self._bucket, name, upload_id))
        return sorted(name[len(base):] for name, _ in uploads)

    def delete(self, key: str) -> None:
        """Delete the object (S3 DELETE is idempotent)."""
        name = self.full_key(key)
        self._call(f"delete {name!r}", lambda: self._client.remove_object(self._bucket, name))


class S3Reader:
    """Read-only access to the objects of one bucket by their full keys: a dataset uploaded
    by the user (no run prefix, no sha256 metadata), read whole as a stream or by byte range
    (``get_object`` with offset and length), with the retries of :class:`S3Client`.
    Errors name the object's ``s3://`` URL."""

    def __init__(self, client: S3Client, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def bucket_exists(self) -> bool:
        return self.client.call(f"stat bucket {self.bucket!r}",
                                lambda: self.client.minio.bucket_exists(self.bucket))

    def size(self, key: str) -> int:
        """The object's size in bytes (HEAD); :class:`ObjectNotFound` when it is missing."""
        stat = self.client.call(f"stat {self.url(key)}",
                                lambda: self.client.minio.stat_object(self.bucket, key))
        return int(stat.size or 0)

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (full keys, recursively) with its size in bytes."""
        def op() -> dict[str, int]:
            return {obj.object_name: int(obj.size or 0)
                    for obj in self.client.minio.list_objects(self.bucket, prefix=prefix,
                                                              recursive=True)
                    if obj.object_name is not None and not obj.is_dir}

        return self.client.call(f"list {self.url(prefix)}", op)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes ``offset`` to ``offset + length - 1`` in one ranged GET (retried whole)."""
        if length <= 0:  # minio reads a length of 0 as "to the end"
            return b""

        def op() -> bytes:
            resp = self.client.minio.get_object(self.bucket, key, offset=offset, length=length)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        data = self.client.call(f"get {self.url(key)} bytes {offset}+{length}", op)
        if len(data) != length:
            raise StorageError(f"{self.url(key)}: asked for {length} bytes at {offset}, got "
                               f"{len(data)} (the object changed?)")
        return data

    def open(self, key: str, offset: int = 0, length: int | None = None,
             buffer_size: int = 1 << 20) -> io.BufferedReader:
        """A buffered binary stream of the object (from ``offset``, ``length`` bytes or to the
        end) over one GET; a transient failure mid-stream reopens it where it stopped."""
        return io.BufferedReader(_RangeStream(self, key, offset, length), buffer_size)


class _RangeStream(io.RawIOBase):
    """The raw stream behind :meth:`S3Reader.open`: one ranged GET, resumed at the current
    position (a new ranged GET) when the connection fails, within the client's retry time."""

    def __init__(self, reader: S3Reader, key: str, offset: int, length: int | None) -> None:
        super().__init__()
        self._reader = reader
        self._key = key
        self._pos = offset
        self._remaining = length
        self._resp: urllib3.BaseHTTPResponse | None = None

    def readable(self) -> bool:
        return True

    def _drop(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp.release_conn()
            self._resp = None

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = len(buffer) if self._remaining is None else min(len(buffer), self._remaining)
        if want == 0:
            return 0
        minio, bucket = self._reader.client.minio, self._reader.bucket

        def op() -> bytes:
            if self._resp is None:
                self._resp = minio.get_object(bucket, self._key, offset=self._pos,
                                              length=self._remaining or 0)
            try:
                return self._resp.read(want)
            except BaseException:
                self._drop()
                raise

        data = self._reader.client.call(
            f"get {self._reader.url(self._key)} from byte {self._pos}", op)
        if not data and self._remaining:
            raise StorageError(f"{self._reader.url(self._key)} ended at byte {self._pos}, "
                               f"{self._remaining} bytes early (the object changed?)")
        count = len(data)
        buffer[:count] = data
        self._pos += count
        if self._remaining is not None:
            self._remaining -= count
        return count

    def close(self) -> None:
        self._drop()
        super().close()
