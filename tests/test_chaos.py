"""bench/chaos.py in short: five seeded faults (one of each kind) on a run of the tiny model
(one index partition, to stay short: tests/test_restarts.py kills a partition), beside an
undisturbed run of the same seed; every check of the soak must pass, and a seed always gives
the same schedule. The runs index MaxP passages (``--passages max``): the chaos guarantees
hold with passages too (the many other end-to-end tests run FirstP)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ance_train_dev import chaos

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e

# Seed 315's five faults (cut 12.5 s at 6 s, Redis at 9 s, kill at 13 s, stop 1.5 s at 17 s,
# slow 7 s at 20 s) are all over 28 s in, while the undisturbed run still goes on: the chaos
# run loses little time to them (seed 3's 20 s cut from 26 s in cost it about 28 s).
SEED = 315


def test_same_seed_same_schedule_and_every_kind_in_five() -> None:
    services = chaos.service_names(replicas=2, partitions=2)
    first = chaos.make_schedule(SEED, 30, services, claim_timeout_s=5)
    assert first == chaos.make_schedule(SEED, 30, services, claim_timeout_s=5)
    assert first != chaos.make_schedule(SEED + 1, 30, services, claim_timeout_s=5)
    assert len(first) > 100 and first[-1].at_s < 30 * 60
    assert Counter(f.kind for f in first[:5]) == dict.fromkeys(chaos.KINDS, 1)
    store = sorted((f for f in first if f.kind in ("cut", "slow")), key=lambda f: f.at_s)
    for a, b in itertools.pairwise(store):
        assert a.at_s + a.duration_s <= b.at_s, "store faults never overlap"
    assert {f.target for f in first if f.kind == "kill"} == set(services)
    # A trainer of several processes: each rank is a target of its own besides the group.
    assert chaos.service_names(replicas=1, partitions=1, trainer_processes=2) == [
        "trainer", "trainer/rank-0", "trainer/rank-1", "indexer", "inferencer-0"]


def test_a_rank_is_found_by_its_environment() -> None:
    """torchrun's workers carry RANK; rank_pid finds the worker of a rank under its parent."""
    spawn = ("import os, subprocess, sys, time\n"
             "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
             " env={**os.environ, 'RANK': str(r)}) for r in (0, 1)]\n"
             "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
             "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        kids = [int(pid) for pid in parent.stdout.readline().split()]
        assert [chaos.rank_pid(parent.pid, r) for r in (0, 1, 2)] == [*kids, None]
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "bench" / "chaos.py"), "--minutes", "2",
               "--faults", "5", "--seed", str(SEED), "--data", "subset", "--steps", "6",
               "--refresh-every", "3", "--shard-size", "5", "--partitions", "1",
               "--claim-timeout", "3",
               "--baseline-seeds", "1", "--passages", "max", "--work", str(tmp_path / "w"),
               "--out", str(out), "--reliability", ""]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "chaos.json").read_text())
    assert report["passed"] and report["lost"] == "nothing"
    for run in (report["chaos"], *report["baselines"]):
        assert run["finished"]
        failed = {name: c for name, c in run["checks"].items() if not c["ok"]}
        assert not failed, failed
        assert len(run["checks"]) == 8
    assert report["quality"]["ok"]
    assert {run["passages"] for run in (report["chaos"], *report["baselines"])} == {"max"}
    # The schedule used is the seed's, and --replay reads it back as it was.
    services = chaos.service_names(replicas=2, partitions=1)
    expected = chaos.make_schedule(SEED, 2, services, claim_timeout_s=3.0, max_faults=5)
    assert report["schedule"] == chaos.schedule_json(SEED, expected)
    assert chaos.read_schedule(out / "chaos.json") == (SEED, expected)
    records = report["chaos"]["faults"]
    # Every fault lands while the run lasts (the last at about 20 s). Six steps keep the
    # chaos run's metrics equal to the baseline's; shards of 5 documents make each refresh
    # ten times the work items, so the run outlasts the schedule now that services start warm
    # (with 50, it ended after about 10 s, before the first fault).
    assert [r["kind"] for r in records] == [f.kind for f in expected], (
        f"the chaos run ({report['chaos']['wall_s']} s) ended before its faults: {records}")
    assert all(r["outcome"] for r in records)
    restarted = Counter(r["service"] for r in report["chaos"]["restarts"])
    assert restarted["redis"] == 1  # the launcher restarted the Redis the nemesis killed
    killed = [r["target"] for r in records if r["kind"] == "kill"
              and r["outcome"] == "killed"]
    assert all(restarted[name] >= 1 for name in killed)
    markdown = (out / "chaos.md").read_text()
    assert "**Lost: nothing.**" in markdown and f"--seed {SEED}" in markdown
