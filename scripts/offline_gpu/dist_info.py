"""Write ance-train's distribution metadata (a ``.dist-info`` folder: METADATA and the entry
points of pyproject.toml) into a folder on ``PYTHONPATH``.

The GPU machines run ance-train from the source tree (``PYTHONPATH=/tmp/site:src:dev``)
without pip-installing it, so no metadata of it exists there; but the configuration finds the
negative strategies through their entry points (``ance_train.config.registered_strategies``)
and refuses to validate without them. This gives them, read from this checkout's
pyproject.toml; the modules they name are then imported from ``src/``. Standard library only.

    python3 scripts/offline_gpu/dist_info.py /tmp/site
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_dist_info(target: Path, pyproject: Path = REPO / "pyproject.toml") -> Path:
    """The ``<name>-<version>.dist-info`` folder written in ``target`` (replacing one left by a
    previous call), with the ``[project.entry-points]`` and ``[project.scripts]`` groups."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    info = target / f"{name.replace('-', '_')}-{version}.dist-info"
    if info.exists():
        shutil.rmtree(info)
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = {**project.get("entry-points", {}), "console_scripts": project.get("scripts", {})}
    lines = []
    for group, entries in groups.items():
        if entries:
            lines += [f"[{group}]", *(f"{key} = {value}" for key, value in entries.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(f"wrote {write_dist_info(Path(sys.argv[1]))}")
