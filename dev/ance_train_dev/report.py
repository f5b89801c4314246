"""What every benchmark records beside its numbers: the exact command, the machine, the date."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL = "minilm"


def model_directory(value: str) -> str:
    """``--model``'s type: a model directory, or ``minilm`` (the default) for the
    all-MiniLM-L6-v2 package. The package is imported only when it is meant, so a machine
    without it (the GPU machine of 2026-11-26) can name a model of its own."""
    if value != DEFAULT_MODEL:
        return value
    from ance_train.config import default_model_path

    return default_model_path()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# CPU features that decide how fast numpy and torch kernels run on this machine.
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_flags(wanted: tuple[str, ...] = NOTABLE_FLAGS) -> list[str]:
    """Which of ``wanted`` the CPU reports in ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


def command_line() -> str:
    return shlex.join([Path(sys.executable).name, *sys.argv])


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def machine(device: str = "cpu") -> dict:
    """The machine a report was measured on. Without importing torch or transformers (2-3
    CPU-s, more than some benchmarks' own work): their installed versions, and the GPU from
    torch if the benchmark imported it, else from ``nvidia-smi``."""
    return {"platform": platform.platform(), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(), "gpu": gpu_name(), "device": device,
            "torch": importlib.metadata.version("torch"),
            "transformers": importlib.metadata.version("transformers")}


def gpu_name() -> str | None:
    """The first GPU's name, or None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return names[0].strip() or None


def machine_line(machine: object) -> str:
    """One line for a report's ``machine`` (as :func:`machine` records it; anything else as
    it is): CPU, cores, flags, GPU, torch."""
    if not isinstance(machine, dict):
        return str(machine)
    flags = ", ".join(machine.get("cpu_flags") or [])
    return (f"{machine.get('cpu')}, {machine.get('cores')} cores"
            + (f" ({flags})" if flags else "") + f", GPU {machine.get('gpu') or 'none'}, "
            f"torch {machine.get('torch')}")


def write_report(out: Path, name: str, report: dict, markdown: str) -> None:
    """``<name>.json`` and ``<name>.md`` into ``out``, and the markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


class Section:
    """A part of a shared document (docs/reliability.md) that one benchmark writes between HTML
    comment markers, so a rerun replaces it and other writers of the document keep it."""

    def __init__(self, name: str, writer: str) -> None:
        self.begin = f"<!-- {name}: written by {writer} -->"
        self.end = f"<!-- /{name} -->"

    def splice(self, document: str, section: str) -> str:
        """``document`` with this section replaced by ``section`` (appended if absent)."""
        block = f"{self.begin}\n{section}{self.end}\n"
        if self.begin in document and self.end in document:
            head, rest = document.split(self.begin, 1)
            return head + block + rest.split(self.end, 1)[1].lstrip("\n")
        return document.rstrip("\n") + "\n\n" + block

    def carry(self, old: str, new: str) -> str:
        """``new`` with this section of ``old`` (if any) carried over."""
        if self.begin not in old or self.end not in old:
            return new
        return self.splice(new, old.split(self.begin, 1)[1].split(self.end, 1)[0].lstrip("\n"))
