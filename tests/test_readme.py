"""README.md's shell commands against the CLI, so the README cannot drift from it.

Every command line of README's ```bash / ```sh blocks is classified by an explicit list of
prefixes: ``RUN`` (cheap: help, version, ``validate``, ``plan``) are run with the venv's
``ance-train`` from the repository root and must exit 0; ``SKIP`` (setup scripts, services,
network, long runs) are named here and not run. A command in neither list fails the test, so a
new README command needs a decision, and at least ``MIN_RUN`` commands must run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ance_train_dev.helpers import scifact_dir

REPO = Path(__file__).resolve().parents[1]
ANCE_TRAIN = Path(sys.executable).parent / "ance-train"

# Token prefixes of the commands this test runs. Any `ance-train ... --help` runs too.
RUN = (
    ("ance-train", "--help"),
    ("ance-train", "--version"),
    ("ance-train", "validate"),
    ("ance-train", "plan"),
)
# Token prefixes of commands that need services, the network, a cluster or a long run.
SKIP = (
    ("bash", "scripts/quickstart.sh"),  # install + a 5-minute training run
    ("bash", "scripts/test.sh"),  # install + the whole suite
    ("ance-train", "run"),
    ("ance-train", "status"),  # needs running services
    ("ance-train", "serve"),
    ("ance-train", "search"),
    ("ance-train", "prepare"),
    ("ance-train", "export"),  # needs a finished run
    ("ance-train", "export-negatives"),
    ("ance-train", "data", "get"),  # network
    ("ance-train", "data", "convert"),  # needs the user's input files
    ("tensorboard",),
    ("helm",),  # a cluster
    ("pip",),
)
MIN_RUN = 6


def readme_commands() -> list[list[str]]:
    """The command lines of README's bash/sh blocks, continuation lines joined, comments cut."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def _starts(argv: list[str], prefixes: tuple[tuple[str, ...], ...]) -> bool:
    return any(tuple(argv[: len(p)]) == p for p in prefixes)


def runs(argv: list[str]) -> bool:
    return _starts(argv, RUN) or (argv[0] == "ance-train" and argv[-1] == "--help")


COMMANDS = readme_commands()
TO_RUN = [argv for argv in COMMANDS if runs(argv)]


def test_every_readme_command_is_run_or_skipped_by_name() -> None:
    unclassified = [shlex.join(a) for a in COMMANDS if not runs(a) and not _starts(a, SKIP)]
    assert not unclassified, f"add these README commands to RUN or SKIP: {unclassified}"
    assert len(TO_RUN) >= MIN_RUN, [shlex.join(a) for a in TO_RUN]
    # the two commands a newcomer needs are stated in the README
    assert ["bash", "scripts/quickstart.sh"] in COMMANDS
    assert ["bash", "scripts/test.sh"] in COMMANDS


@pytest.mark.parametrize("argv", TO_RUN, ids=[" ".join(a[:3]) for a in TO_RUN])
def test_readme_command_exits_0(argv: list[str]) -> None:
    assert ANCE_TRAIN.is_file(), f"no ance-train next to {sys.executable}"
    command = [str(ANCE_TRAIN), *argv[1:]]
    if argv[1] == "validate" and argv[-1] != "--help":
        # the SciFact copy the tests use (ANCE_SCIFACT_DIR), as scripts/quickstart.sh does
        command += ["--set", f"data.path={scifact_dir()}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (shlex.join(argv), result.stdout[-3000:], result.stderr[-3000:])
