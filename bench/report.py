"""What every benchmark records beside its numbers: the exact command, the machine, the date."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path


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
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(),
            "gpu": gpu, "device": device, "torch": torch.__version__,
            "transformers": transformers.__version__}


def write_report(out: Path, name: str, report: dict, markdown: str) -> None:
    """``<name>.json`` and ``<name>.md`` into ``out``, and the markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
