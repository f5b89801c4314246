"""Which GPU architectures a CUDA shared library carries code for: reads the fat binaries
embedded in it (header magic 0xBA55ED50) and counts their entries by kind (SASS, the
machine code of one architecture, or PTX, which the driver compiles for its own GPU at load).
A GPU runs a kernel if the library has SASS of its major version (sm_80 code runs on sm_86)
or PTX of an older-or-equal architecture. No CUDA needed: it reads bytes.

    python scripts/offline_gpu/cuda_archs.py path/to/libfaiss.so
"""

from __future__ import annotations

import collections
import struct
import sys

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "ptx", 2: "sass"}


def architectures(data: bytes) -> collections.Counter[tuple[str, int]]:
    """(kind, sm) → number of fat-binary entries."""
    found: collections.Counter[tuple[str, int]] = collections.Counter()
    at = data.find(FATBIN_MAGIC)
    while at != -1:
        try:
            _, _, header_size, body_size = struct.unpack_from("<IHHQ", data, at)
            entry, end = at + header_size, at + header_size + body_size
            while entry < end:
                kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
                sm = struct.unpack_from("<I", data, entry + 28)[0]
                found[(KINDS.get(kind, str(kind)), sm)] += 1
                if entry_header == 0:
                    break
                entry += entry_header + entry_size
        except struct.error:  # a stray match of the magic near the end of the file
            pass
        at = data.find(FATBIN_MAGIC, at + 4)
    return found


def main() -> int:
    for path in sys.argv[1:]:
        with open(path, "rb") as handle:
            found = architectures(handle.read())
        listed = ", ".join(f"{kind} sm_{sm} ×{n}" for (kind, sm), n in sorted(found.items()))
        print(f"{path}: {listed or 'no CUDA fat binary'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
