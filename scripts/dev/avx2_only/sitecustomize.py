"""Hides the CPU's AVX-512 and AMX flags from ``/proc/cpuinfo`` as Python code reads it, in
every Python process started with this directory on ``PYTHONPATH`` (scripts/dev/avx2_only.sh).

Part of an emulated AVX2-only machine (no AVX-512, no bf16), with the libraries' own ISA
limits that the script sets: what reads the flags (``inference.precision: auto`` choosing
fp32, the benchmarks' machine labels) then sees such a CPU. An emulation, not such a machine:
the cores, caches and clocks are this machine's.
"""

from __future__ import annotations

import pathlib

HIDDEN = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int8")
_read_text = pathlib.Path.read_text


def _without_hidden_flags(text: str) -> str:
    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith("flags") and ":" in line:
            key, flags = line.split(":", 1)
            kept = [f for f in flags.split() if not f.startswith(HIDDEN)]
            line = f"{key}: {' '.join(kept)}\n"
        lines.append(line)
    return "".join(lines)


def read_text(self: pathlib.Path, *args: object, **kwargs: object) -> str:
    text = _read_text(self, *args, **kwargs)  # type: ignore[arg-type]
    return _without_hidden_flags(text) if str(self) == "/proc/cpuinfo" else text


pathlib.Path.read_text = read_text  # type: ignore[method-assign]
