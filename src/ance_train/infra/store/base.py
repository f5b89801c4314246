"""What every object store backend shares: the :class:`ObjectStore` interface and its derived
operations (JSON, directories with a manifest, verified downloads), the errors, key and run-id
validation, and the checksum helpers.

Keys are *relative* to the run (``"checkpoints/100/config.json"``); a store prefixes
``<run_id>/``.  :func:`validate_key` makes sure a key can never escape the run's prefix nor
collide with a checksum sidecar (``*.sha256``) or a temp file.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ance_train.infra.atomic import atomic_write

if TYPE_CHECKING:
    from ance_train.infra.store.verified import VerifiedReader

MANIFEST_NAME = "MANIFEST.json"
SIDECAR_SUFFIX = ".sha256"
_TMP_MARKER = ".ance-tmp"
_CHUNK = 1 << 20
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


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


def _copy_hashed(src: IO[bytes], dst: IO[bytes] | None = None) -> tuple[str, int]:
    """Read ``src`` to its end in chunks (writing them to ``dst`` when given); return the
    (sha256 hex, size) of what was read."""
    h = hashlib.sha256()
    size = 0
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
        if dst is not None:
            dst.write(chunk)
    return h.hexdigest(), size


def _hash_file(path: Path) -> tuple[str, int]:
    """Return (sha256 hex, size) of a local file."""
    with open(path, "rb") as f:
        return _copy_hashed(f)


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
    def put_file(self, key: str, path: str | os.PathLike[str], share: bool = False) -> str:
        """Upload a local file under ``key``; return its sha256.

        ``share``: the caller will never modify ``path`` in place (it may delete it or
        replace it by a rename), so a store on the same filesystem may keep ``path``'s
        bytes themselves (a hard link) instead of a copy. A file changed in place anyway
        makes the object corrupt (its checksum no longer matches), never silently different.
        """

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
    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Bytes of every object under ``prefix`` (as :meth:`list` selects them), by key: one
        listing (S3 LIST carries each size; locally one stat per file), no object read."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object (no error if it does not exist)."""

    def usage(self, prefix: str = "") -> int:
        """Total bytes of the objects under ``prefix`` (``""``: the whole run)."""
        return sum(self.sizes(prefix).values())

    # builtins.list: in the class body ``list`` is the method above.
    def abort_unfinished_uploads(self) -> builtins.list[str]:
        """Abort the run's uploads that were started and never completed (an S3 multipart
        upload whose writer was killed or cut off: its parts are stored, and billed, but no
        object shows them); returns their keys. Only when no writer of the run is alive
        (it would abort an upload in flight). A store without such uploads has none."""
        return []

    # ---- derived operations

    @contextlib.contextmanager
    def open_verified(self, key: str) -> Iterator[VerifiedReader]:
        """The object as a :class:`~ance_train.infra.store.verified.VerifiedReader`, for a
        caller that reads it straight into its own buffers. Here it is downloaded whole and
        verified first; a backend that can stream it (the local one) hashes it as it is
        read."""
        from ance_train.infra.store.verified import VerifiedReader

        data = self.get_bytes(key)
        yield VerifiedReader(key, io.BytesIO(data), len(data), None)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> str:
        """Download the object to ``path`` (temp file + ``os.replace``); return its sha256.

        ``path`` is only replaced once the checksum has been verified.
        """
        return self._get_file_checked(key, Path(path), None)

    def _get_file_checked(self, key: str, path: Path, expected: str | None) -> str:
        validate_key(key)

        def download(f: IO[bytes]) -> str:
            sha = self._download_to(key, f)
            if expected is not None and sha != expected:
                raise CorruptObject(
                    f"object {key!r} has sha256 {sha} but the manifest records {expected}"
                )
            return sha

        return atomic_write(path, download, suffix=_TMP_MARKER)

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

    @staticmethod
    def dir_files(directory: str | os.PathLike[str],
                  reserved: Iterable[str] = (MANIFEST_NAME,)) -> builtins.list[str]:
        """The relative paths (``/``-separated, sorted) of every file under ``directory``,
        each a valid key; a file named like a manifest (``reserved``) is refused."""
        root = Path(directory)
        if not root.is_dir():
            raise StorageError(f"put_dir: {str(root)!r} is not a directory")
        reserved = set(reserved)
        rels: builtins.list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                p = Path(dirpath, name)
                if not p.is_file():
                    continue
                rel = p.relative_to(root).as_posix()
                validate_key(rel)
                if rel in reserved:
                    raise StorageError(
                        f"put_dir: {str(root)!r} contains {rel}, a reserved name"
                    )
                rels.append(rel)
        return sorted(rels)

    def put_files(self, prefix: str, directory: str | os.PathLike[str], rels: Iterable[str],
                  share: bool = False) -> dict[str, dict[str, Any]]:
        """Upload the files ``rels`` of ``directory`` to ``<prefix>/<rel>``; return their
        manifest entries (``{rel: {"sha256", "size"}}``). No manifest is written
        (:meth:`put_manifest` does); ``share`` as in :meth:`put_file`."""
        prefix = _validate_prefix(prefix)
        root = Path(directory)
        files: dict[str, dict[str, Any]] = {}
        for rel in rels:
            p = root / rel
            key = _join(prefix, validate_key(rel))
            sha = self.put_file(key, p, share=True) if share else self.put_file(key, p)
            files[rel] = {"sha256": sha, "size": p.stat().st_size}
        return files

    def put_manifest(self, prefix: str, files: Mapping[str, Mapping[str, Any]],
                     name: str = MANIFEST_NAME) -> dict[str, Any]:
        """Write ``<prefix>/<name>``, the manifest of ``files`` (entries of
        :meth:`put_files`): ``{"version": 1, "files": {rel: {"sha256", "size"}}}``."""
        manifest = {"version": 1, "files": {rel: dict(info) for rel, info in files.items()}}
        self.put_json(_join(_validate_prefix(prefix), validate_key(name)), manifest)
        return manifest

    def put_dir(self, prefix: str, directory: str | os.PathLike[str],
                share: bool = False) -> dict[str, Any]:
        """Upload every file under ``directory`` (recursively) to ``<prefix>/<relative path>``.

        ``<prefix>/MANIFEST.json`` (``{"version": 1, "files": {rel: {"sha256", "size"}}}``)
        is deleted first and written last, so a reader never sees a half-uploaded
        directory as complete.  Returns the manifest. ``share`` as in :meth:`put_file`.
        """
        prefix = _validate_prefix(prefix)
        rels = self.dir_files(directory)
        self.delete(_join(prefix, MANIFEST_NAME))
        return self.put_manifest(prefix, self.put_files(prefix, directory, rels, share=share))

    def get_dir(self, prefix: str, directory: str | os.PathLike[str],
                skip: Callable[[str], bool] | None = None,
                manifest_name: str = MANIFEST_NAME) -> dict[str, Any]:
        """Download a directory written by :meth:`put_dir` into ``directory``.

        Requires ``<prefix>/<manifest_name>`` (``MANIFEST.json`` unless told; ObjectNotFound
        otherwise) and downloads the files it lists; every file is verified against its own
        checksum and against the manifest.  Files whose relative path ``skip`` accepts are
        not downloaded (an inferencer needs no optimizer state). Returns the manifest.
        """
        prefix = _validate_prefix(prefix)
        manifest_key = _join(prefix, validate_key(manifest_name))
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
