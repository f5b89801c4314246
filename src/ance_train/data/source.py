"""Where a dataset file's bytes come from: a local file, or an object of an ``s3://`` dataset
read through the run's S3 settings (``ANCE_S3_ENDPOINT``, ``ANCE_S3_ACCESS_KEY``,
``ANCE_S3_SECRET_KEY``, ``ANCE_S3_SECURE``, ``ANCE_S3_REGION``, ``ANCE_S3_RETRY_SECONDS``: the
same endpoint, keys and TLS as the run's object store; the bucket is the URL's).

Validation streams each file once (:func:`open_binary`); the corpus reader asks for byte
ranges (:func:`read_range`, one ranged GET each). Nothing here loads a file whole.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import IO

from ance_train.config import S3Url
from ance_train.data.problems import DataError
from ance_train.infra.store import ObjectNotFound, S3Reader, s3_client_from_env

DataFile = Path | S3Url
"""A dataset file: a local path or an object in a bucket."""


_SETTINGS = ("ANCE_S3_ENDPOINT", "ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY", "ANCE_S3_SECURE",
             "ANCE_S3_REGION", "ANCE_S3_RETRY_SECONDS")


def reader(url: S3Url) -> S3Reader:
    """The reader of ``url``'s bucket with the run's S3 settings: one client per settings
    and process (a forked child never shares the parent's pooled connections; a test that
    changes the settings never reads with stale ones)."""
    return _reader(url.bucket, tuple(os.environ.get(name, "") for name in _SETTINGS),
                   os.getpid())


@functools.lru_cache(maxsize=8)
def _reader(bucket: str, settings: tuple[str, ...], pid: int) -> S3Reader:
    client = s3_client_from_env(dict(zip(_SETTINGS, settings, strict=True)))
    if client is None:
        raise DataError(f"data.path is s3://{bucket}/… but ANCE_S3_ENDPOINT is not set: the "
                        "dataset is read with the run's S3 settings (ANCE_S3_ENDPOINT, "
                        "ANCE_S3_ACCESS_KEY, ANCE_S3_SECRET_KEY, ANCE_S3_SECURE)")
    return S3Reader(client, bucket)


def exists(file: DataFile) -> bool:
    if isinstance(file, S3Url):
        try:
            reader(file).size(file.key)
        except ObjectNotFound:
            return False
        return True
    return file.is_file()


def check_root(root: DataFile) -> None:
    """Raise :class:`DataError` when the dataset's directory (or bucket) does not exist."""
    if isinstance(root, S3Url):
        if not reader(root).bucket_exists():
            raise DataError(f"dataset {root}: the bucket {root.bucket!r} does not exist")
    elif not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist or is not a directory")


def file_size(file: DataFile) -> int:
    if isinstance(file, S3Url):
        try:
            return reader(file).size(file.key)
        except ObjectNotFound:
            raise DataError(f"{file} does not exist (any more)") from None
    return file.stat().st_size


def open_binary(file: DataFile) -> IO[bytes]:
    """The file as a binary stream; an object is read in one GET, resumed where it stopped
    after a transient failure. A missing object raises :class:`DataError` naming it."""
    if isinstance(file, S3Url):
        stream = reader(file).open(file.key)
        try:
            stream.peek(1)  # the GET happens here, so a missing object fails before parsing
        except ObjectNotFound:
            stream.close()
            raise DataError(f"{file} does not exist") from None
        return stream
    return open(file, "rb")


def read_range(file: S3Url, offset: int, length: int) -> bytes:
    """Bytes ``offset`` to ``offset + length - 1`` of an object: one ranged GET."""
    return reader(file).read_range(file.key, offset, length)
