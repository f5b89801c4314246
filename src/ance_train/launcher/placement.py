"""Which GPUs each service process of an embedded run sees (``CUDA_VISIBLE_DEVICES``).

- The trainer's ranks (``training.processes``) get the first GPUs, one each (rank r trains on
  ``cuda:r`` of what it sees: trainer/distributed.py).
- The inferencers get the rest, round-robin; with no GPU left they share all of them,
  round-robin from the first.
- The indexer (each partition) gets a GPU no inferencer uses when one is left, else it shares
  one (counted from the last). With ``index.device: cpu`` it sees none. FAISS then searches on
  what it sees when it can (``index.device: auto``, index/ann.py).

The GPUs counted are those of ``CUDA_VISIBLE_DEVICES`` when the launcher's environment sets it,
else those ``nvidia-smi -L`` lists; ``ANCE_GPU_COUNT=n`` keeps the first n of them (or, with
neither, pretends there are n: the tests place on machines without a GPU). Nothing here imports
torch: the launcher stays light.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
GPU_COUNT_VAR = "ANCE_GPU_COUNT"
NVIDIA_SMI_TIMEOUT_S = 30


def nvidia_smi_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (its MIG lines are not counted), 0 without the tool."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if done.returncode != 0:
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids the run's processes may be given (module docstring)."""
    env = os.environ if env is None else env
    listed = ([d.strip() for d in env[VISIBLE_VAR].split(",") if d.strip()]
              if VISIBLE_VAR in env else None)
    override = env.get(GPU_COUNT_VAR, "").strip()
    if override:
        try:
            count = int(override)
        except ValueError:
            raise ValueError(f"{GPU_COUNT_VAR}={override!r} is not a number of GPUs") from None
        if count < 0:
            raise ValueError(f"{GPU_COUNT_VAR}={count}: must be >= 0")
        return listed[:count] if listed is not None else [str(i) for i in range(count)]
    if listed is not None:
        return listed
    return [str(i) for i in range(nvidia_smi_gpus())]


@dataclass(frozen=True)
class Placement:
    gpus: list[str]
    devices: dict[str, list[str]] = field(default_factory=dict)  # process name → its GPUs
    notes: list[str] = field(default_factory=list)

    def env(self, name: str) -> dict[str, str]:
        """What to lay over process ``name``'s environment: nothing on a machine without a
        GPU, else its ``CUDA_VISIBLE_DEVICES`` (empty: it sees none)."""
        if not self.gpus:
            return {}
        return {VISIBLE_VAR: ",".join(self.devices.get(name, []))}

    def describe(self) -> list[str]:
        if not self.gpus:
            return ["GPUs: none found (nvidia-smi lists none): every service runs on the CPU"]
        users: dict[str, list[str]] = {}
        for name, devices in self.devices.items():
            for device in devices:
                users.setdefault(device, []).append(name)
        lines = [f"GPU placement ({len(self.gpus)} GPU(s) {','.join(self.gpus)}; "
                 f"{VISIBLE_VAR} per process):"]
        for name, devices in self.devices.items():
            shared = sorted({u for d in devices for u in users[d]} - {name})
            lines.append(f"  {name} → " + (",".join(devices) if devices else "no GPU (CPU)")
                         + (f" (shared with {', '.join(shared)})" if shared else ""))
        return lines + [f"  note: {note}" for note in self.notes]


def place(gpus: Sequence[str], trainer_processes: int, inferencers: Sequence[str],
          indexers: Sequence[str], index_on_gpu: bool = True) -> Placement:
    """Devices of the trainer (named ``trainer``), each inferencer and each indexer process
    (by name) over ``gpus`` (module docstring)."""
    gpus = list(gpus)
    if not gpus:
        return Placement([])
    notes: list[str] = []
    ranks = min(trainer_processes, len(gpus))
    if trainer_processes > len(gpus):
        notes.append(f"training.processes is {trainer_processes} but there are {len(gpus)} "
                     f"GPU(s): each rank trains on its own GPU, so ranks {len(gpus)} and "
                     "above have none")
    devices: dict[str, list[str]] = {"trainer": gpus[:ranks]}
    rest = gpus[ranks:]
    pool = rest or gpus
    if not rest:
        notes.append("no GPU left after the trainer's: the inferencers share the trainer's")
    for i, name in enumerate(inferencers):
        devices[name] = [pool[i % len(pool)]]
    free = rest[len(inferencers):]
    for p, name in enumerate(indexers):
        if not index_on_gpu:
            devices[name] = []
        elif free:
            devices[name] = [free[p % len(free)]]
        else:
            devices[name] = [pool[-1 - p % len(pool)]]
    return Placement(gpus, devices, notes)
