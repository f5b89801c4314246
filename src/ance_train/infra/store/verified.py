"""One object read as a stream into the caller's own buffers, verified against its checksum.

:meth:`ObjectStore.open_verified <ance_train.infra.store.base.ObjectStore.open_verified>`
hands one out. Each chunk is hashed as soon as it lands in the caller's buffer (while it is
still in the CPU's cache), so a large object is read once and no copy of it is made; what
:meth:`VerifiedReader.verify` checks is exactly the bytes the caller now holds. Until
``verify`` returns, the caller must treat them as unverified (and throw them away when it
raises).
"""

from __future__ import annotations

import hashlib
import io

from ance_train.infra.store.base import _SHA_RE, CorruptObject, StorageError, _verify

# Bytes read (then hashed) at a time: a chunk still in the cache when it is hashed.
CHUNK = 1 << 18


class VerifiedReader:
    """The ``size`` bytes of object ``key``, read in order with :meth:`readinto`.

    ``expected``: the object's recorded sha256; None where the backend verified the bytes
    before handing them out (it downloaded the object whole).
    """

    def __init__(self, key: str, source: io.RawIOBase | io.BufferedIOBase, size: int,
                 expected: str | None) -> None:
        if expected is not None and not _SHA_RE.match(expected.strip().lower()):
            raise CorruptObject(f"object {key!r} has no valid sha256 checksum recorded")
        self.key = key
        self.size = size
        self._source = source
        self._expected = expected
        self._hash = None if expected is None else hashlib.sha256()
        self._read = 0

    def readinto(self, buffer: memoryview) -> None:
        """Fill ``buffer`` (bytes-like, writable) with the object's next ``len(buffer)``
        bytes; CorruptObject when the object ends first."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            try:
                n = self._source.readinto(view[done:done + CHUNK])
            except OSError as error:
                raise StorageError(f"get {self.key!r} failed: {error}") from error
            if not n:
                raise CorruptObject(f"object {self.key!r} ends after {self._read + done} "
                                    f"bytes; {self.size} were expected")
            if self._hash is not None:
                self._hash.update(view[done:done + n])
            done += n
        self._read += done

    def verify(self) -> None:
        """CorruptObject unless the whole object was read, nothing follows it, and its sha256
        is the recorded one."""
        if self._read != self.size or self._source.read(1):
            raise CorruptObject(f"object {self.key!r}: {self._read} bytes read, but it does "
                                f"not hold {self.size}")
        if self._hash is not None:
            _verify(self.key, self._expected, self._hash.hexdigest())
