"""How long the test suite takes, and how much CPU it burns, at one or more commits (issue 29).

Each commit is checked out into a detached worktree beside this repository (so that its
tests find ``../shared/data``), and its suite runs as ``scripts/test.sh`` runs it
(``python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup``) with this venv, the
worktree's ``src`` and ``dev`` first on ``PYTHONPATH``, and this checkout's ``.cache``
(the TLS redis-server). The commits run one after another, never side by side. Recorded per
commit:

- ``wall_s``: the pytest command's wall-clock time (what the 12- and 15-minute rules count);
- ``machine_cpu_s``: CPU-seconds the whole machine spent meanwhile (``/proc/stat``: user,
  nice, system, irq, softirq), which counts every service process even after it was
  reparented; run on an otherwise idle machine (the load average before is recorded);
- ``tree_cpu_s``: user + system CPU of pytest and the descendants it waited for;
- the pass/fail line of pytest.

On a machine whose suite is CPU-bound (a slower CPU than this one), the CPU-seconds are what
scales; here, with cores to spare at moments, the wall time also holds waits on purpose
(fault tests hold an outage for 30 s).

    python bench/suite_time.py --commits 76c3a29 HEAD
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from ance_train_dev.report import command_line, cpu_flags, cpu_model, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]


def machine_cpu_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_suite(commit: str, log_dir: Path) -> dict:
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = REPO.parent / f"suite-time-{sha}"
    subprocess.run(["git", "worktree", "add", "-f", "--detach", str(tree), sha], cwd=REPO,
                   check=True, capture_output=True)
    try:
        if (REPO / ".cache").exists() and not (tree / ".cache").exists():
            (tree / ".cache").symlink_to(REPO / ".cache")
        env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}:{tree / 'dev'}")
        log = log_dir / f"suite-{sha}.log"
        load = os.getloadavg()[0]
        machine0, tree0, started = machine_cpu_seconds(), tree_cpu_seconds(), time.monotonic()
        with open(log, "w") as out:
            code = subprocess.run([sys.executable, *PYTEST], cwd=tree, env=env, stdout=out,
                                  stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - started
        machine_cpu, tree_cpu = machine_cpu_seconds() - machine0, tree_cpu_seconds() - tree0
        lines = [line for line in log.read_text().splitlines()
                 if re.search(r"\d+ (passed|failed)", line)]
        return {"commit": sha, "exit_code": code, "wall_s": round(wall, 1),
                "machine_cpu_s": round(machine_cpu, 1), "tree_cpu_s": round(tree_cpu, 1),
                "result": lines[-1].strip("= ") if lines else "(no summary line)",
                "load_before": round(load, 2), "log": str(log)}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                       capture_output=True)


def markdown(report: dict) -> str:
    rows = "\n".join(
        f"| {r['commit']} | {r['result']} | {r['wall_s']:.0f} s ({r['wall_s'] / 60:.1f} min) "
        f"| {r['machine_cpu_s']:.0f} | {r['tree_cpu_s']:.0f} | {r['load_before']} |"
        for r in report["runs"])
    return (f"# Test suite time\n\n`{report['command']}`, {report['date']}, on "
            f"{report['machine']['cpu']} ({report['machine']['cores']} cores; "
            f"{', '.join(report['machine']['cpu_flags']) or 'no notable flags'}). "
            "Each commit's suite as `scripts/test.sh` runs it (`"
            + " ".join(["python", *PYTEST]) + "`), one after another.\n\n"
            "| commit | result | wall | machine CPU-s | pytest tree CPU-s | load before |\n"
            "|---|---|---:|---:|---:|---:|\n" + rows + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs="+", default=["HEAD"])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="suite-time")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    runs = [run_suite(commit, args.logs) for commit in args.commits]
    report = {"command": command_line(), "date": utc_now(),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "cpu_flags": cpu_flags()}, "runs": runs}
    write_report(args.out, args.name, report, markdown(report))


if __name__ == "__main__":
    main()
