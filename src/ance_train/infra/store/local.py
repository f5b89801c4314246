"""The local-directory backend (embedded mode): objects as files with a sha256 sidecar."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from ance_train.infra.atomic import atomic_write
from ance_train.infra.store.base import (
    _TMP_MARKER,
    SIDECAR_SUFFIX,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    _copy_hashed,
    _fsync_dir,
    _validate_prefix,
    _verify,
    validate_key,
)
from ance_train.infra.store.verified import VerifiedReader


def _link_hashed(source: Path, path: Path) -> str | None:
    """Hard-link ``source`` to a temp name beside ``path``, hash and fsync it (at once), rename
    it to ``path``; its sha256, or None where no link can be made (the caller copies instead)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{_TMP_MARKER}")
    try:
        os.link(source, tmp)
    except OSError:  # EXDEV (another filesystem), EPERM / ENOTSUP (no hard links), ...
        return None
    try:
        with open(tmp, "rb") as f, ThreadPoolExecutor(1, "store-sync") as sync:
            # the bytes are on disk before the sidecar says so: synced while they are hashed
            synced = sync.submit(os.fsync, f.fileno())
            sha, _ = _copy_hashed(f)
            synced.result()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return sha


class LocalStore(ObjectStore):
    """Objects as files under ``root/<run_id>/<key>`` with a ``<key>.sha256`` sidecar.

    The sidecar is written after the data (both via temp file + fsync + ``os.replace``);
    a data file without a sidecar is an incomplete write and is treated as absent.

    ``put_file(..., share=True)`` (the trainer's checkpoints) hard-links the caller's file
    instead of copying it when both are on one filesystem: the object and the caller's file
    are then the same bytes, which is safe because the caller never writes into that file
    again and the store never writes into an object (every write is a new file renamed over
    the key; a delete only unlinks). Anywhere a link fails (another filesystem, a filesystem
    without hard links) the file is copied as always.
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

    def _commit(self, key: str, write_data: Callable[[IO[bytes]], str],
                link_from: Path | None = None) -> str:
        """The one way an object is written: ``write_data`` writes the bytes into a temp file
        and returns their sha256 (or, with ``link_from``, that file is hard-linked to the
        temp name and hashed, ``write_data`` being the fallback where a link fails); the
        file replaces the data, then the sidecar is written."""
        path = self._path(key)
        sidecar = self._sidecar(path)
        with self._errors("put", key):
            # Drop the old checksum first: while the data is replaced the object is absent.
            sidecar.unlink(missing_ok=True)
            sha = None if link_from is None else _link_hashed(link_from, path)
            if sha is None:
                sha = atomic_write(path, write_data, suffix=_TMP_MARKER)
            atomic_write(sidecar, lambda f: f.write(sha.encode("ascii") + b"\n"),
                         suffix=_TMP_MARKER)
            _fsync_dir(path.parent)
        return sha

    def put_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key``; return its sha256."""
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()

        def write(f: IO[bytes]) -> str:
            f.write(data)
            return sha

        return self._commit(key, write)

    def put_file(self, key: str, path: str | os.PathLike[str], share: bool = False) -> str:
        """Copy a local file into the store (hashing while copying), or with ``share``
        hard-link it where the filesystem allows (class docstring); return its sha256."""
        validate_key(key)
        with open(path, "rb") as src:
            return self._commit(key, lambda f: _copy_hashed(src, f)[0],
                                link_from=Path(path) if share else None)

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

    @contextlib.contextmanager
    def open_verified(self, key: str) -> Iterator[VerifiedReader]:
        """The object's file as a stream, each chunk hashed as it is read (one pass, no
        copy of it in memory); the checksum is its sidecar's."""
        path = self._path(key)
        expected = self._read_sidecar(key, path)
        with self._errors("get", key):
            source = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
        with source:
            yield VerifiedReader(key, source, os.fstat(source.fileno()).st_size, expected)

    def _download_to(self, key: str, f: IO[bytes]) -> str:
        path = self._path(key)
        expected = self._read_sidecar(key, path)
        with self._errors("get", key), open(path, "rb") as src:
            sha, _ = _copy_hashed(src, f)
        _verify(key, expected, sha)
        return sha

    def exists(self, key: str) -> bool:
        """Whether the object and its checksum sidecar both exist."""
        path = self._path(key)
        return path.is_file() and self._sidecar(path).is_file()

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` (sidecars, temp files and incomplete objects skipped)."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Bytes of each complete object under ``prefix`` (its data file; sidecars are the
        backend's bookkeeping, as S3's metadata is)."""
        prefix = _validate_prefix(prefix)
        base = self._run_dir / prefix if prefix else self._run_dir
        if not base.is_dir():
            return {}
        sizes: dict[str, int] = {}
        for dirpath, _dirnames, filenames in os.walk(base):
            names = set(filenames)
            for name in filenames:
                if name.endswith(SIDECAR_SUFFIX) or _TMP_MARKER in name:
                    continue
                if name + SIDECAR_SUFFIX not in names:
                    continue  # incomplete write
                path = Path(dirpath, name)
                try:
                    size = path.stat().st_size
                except FileNotFoundError:  # deleted since the walk saw it
                    continue
                sizes[path.relative_to(self._run_dir).as_posix()] = size
        return sizes

    def delete(self, key: str) -> None:
        """Remove the sidecar (the object disappears), then the data file."""
        path = self._path(key)
        with self._errors("delete", key):
            self._sidecar(path).unlink(missing_ok=True)
            if path.is_file() or path.is_symlink():
                path.unlink(missing_ok=True)
        # Directories left empty go too (a deleted refresh leaves no ``embeddings/<k>/``);
        # one a concurrent writer has just filled is not empty and stays.
        parent = path.parent
        while parent != self._run_dir and self._run_dir in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
