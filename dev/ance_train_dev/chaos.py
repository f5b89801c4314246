"""A seeded chaos soak: a whole embedded run under random faults, checked for anything lost.

    python bench/chaos.py --minutes 30 --seed 7            # → docs/benchmarks/chaos.{json,md}
    python bench/chaos.py --replay chaos-schedule.json      # the same faults again
    python bench/chaos.py --minutes 1 --faults 5 --data subset --out /tmp/c --reliability ''
    python bench/chaos.py --render docs/benchmarks/chaos.json --notes notes.md   # publish again

One invocation runs, side by side as separate worker processes (``--worker``), the *chaos*
run and the undisturbed *baseline* runs (the same configuration; seed ``--seed`` and, for the
seed-to-seed noise, ``--baseline-seeds`` − 1 more). Each is the embedded mode
(:class:`~ance_train.launcher.embedded.EmbeddedRun`: a private redis-server, the trainer,
``--replicas`` inferencers, ``--partitions`` index partitions, each an OS process, restarted by
the launcher when it dies) with a tiny random BERT, storing everything in a real S3 server
(moto) that each run reaches through its own loopback TCP proxy (dev/ance_train_dev/tcp_proxy.py).

In the chaos run a seeded nemesis, every 3–10 s (uniform), injects the next fault of a
schedule drawn from ``--seed`` before the run starts (kinds drawn from a shuffled bag, so
every kind comes once in any five faults in a row):

* ``kill``: SIGKILL of a service's process group (the trainer with all its ranks, an
  inferencer replica, the indexer or a partition); the launcher restarts it. With
  ``--trainer-processes`` > 1 a target may also be one rank (``trainer/rank-R``): only that
  process dies, and torchrun restarts the group from the last checkpoint (after
  ``training.max_restarts`` such restarts torchrun exits and the launcher restarts it);
* ``stop``: SIGSTOP, then SIGCONT 1 s to 2 × ``inference.claim_timeout_s`` later (a frozen
  replica's item is reclaimed by another; a frozen rank holds the others in a collective);
* ``redis``: SIGKILL of redis-server; the launcher restarts it on its port and AOF directory;
* ``cut``: the store's proxy resets every connection for 2–20 s;
* ``slow``: the store's proxy holds every chunk 50–500 ms for 5–30 s.

The schedule is printed and stored; ``--replay`` takes it (or a report holding it) back.
Faults stop when the chaos run finishes (the report counts those left over).

At the end every run is checked: it finished; every refresh announced (``negatives.ready``,
``eval.completed``) was announced once and has every corpus document exactly once in its
stored shards (with ``--passages max``: every passage of every document once), and every
shard in the ``shard.encoded`` events; no negatives table holds a positive of its query;
every per-step list of the trainer summary has each step once; no work item is left pending
and nothing was dead-lettered; after the launcher stopped: no service process alive, no
Redis key beyond the run's own (read from the AOF again), no temporary object or unfinished
multipart upload in the store. The chaos run's final dev and test nDCG@10 must differ from
the same seed's baseline by at most the noise: the largest difference between the baseline
seeds, or ``--tolerance`` if larger (see the report). Results: JSON + markdown (``--out``,
``--name``) and the "Chaos soak" section of docs/reliability.md (between HTML comment
markers, replaced by each run).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ance_train_dev.report import Section, command_line, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[2]

SECTION = Section("chaos", "bench/chaos.py")
KINDS = ("kill", "stop", "redis", "cut", "slow")
SCIFACT = REPO.parent / "shared" / "data" / "scifact"


# -- the schedule ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    at_s: float  # after the chaos run's services were started
    kind: str
    target: str | None = None  # a service instance (kill, stop)
    duration_s: float | None = None  # stop, cut, slow
    delay_s: float | None = None  # slow: per chunk


RANK_TARGET = "trainer/rank-"


def service_names(replicas: int, partitions: int, trainer_processes: int = 1) -> list[str]:
    """The embedded launcher's instance names (launcher/embedded.py, start_services), and each
    trainer rank (``trainer/rank-R``) when the trainer has several processes."""
    indexers = ["indexer"] if partitions == 1 else [f"indexer-{p}" for p in range(partitions)]
    ranks = ([f"{RANK_TARGET}{r}" for r in range(trainer_processes)]
             if trainer_processes > 1 else [])
    return ["trainer", *ranks, *indexers, *(f"inferencer-{r}" for r in range(replicas))]


def rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The process id of trainer rank ``rank`` under torchrun (None while there is none)."""
    from ance_train_dev.ranks import rank_process

    process = rank_process(torchrun_pid, rank)
    return None if process is None else process.pid


def make_schedule(seed: int, minutes: float, services: list[str], claim_timeout_s: float,
                  max_faults: int | None = None) -> list[Fault]:
    """The faults of ``seed``: a pure function of its arguments (same seed, same schedule).
    Two store faults never overlap (a later one starts when the earlier ends)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    bag: list[str] = []
    store_free_at = 0.0
    at = rng.uniform(3, 10)
    while at < minutes * 60 and (max_faults is None or len(faults) < max_faults):
        if not bag:
            bag = list(KINDS)
            rng.shuffle(bag)
        kind = bag.pop()
        if kind == "kill":
            faults.append(Fault(round(at, 2), kind, rng.choice(services)))
        elif kind == "stop":
            faults.append(Fault(round(at, 2), kind, rng.choice(services),
                                round(rng.uniform(1.0, 2 * claim_timeout_s), 2)))
        elif kind == "redis":
            faults.append(Fault(round(at, 2), kind, "redis"))
        else:
            start = max(at, store_free_at)
            duration = rng.uniform(2, 20) if kind == "cut" else rng.uniform(5, 30)
            delay = round(rng.uniform(0.05, 0.5), 3) if kind == "slow" else None
            if start < minutes * 60:  # not pushed past the end by the one before
                faults.append(Fault(round(start, 2), kind, None, round(duration, 2), delay))
                store_free_at = start + duration + 0.5
        at += rng.uniform(3, 10)
    return sorted(faults, key=lambda f: f.at_s)


def schedule_json(seed: int, faults: list[Fault]) -> dict:
    return {"seed": seed, "faults": [asdict(f) for f in faults]}


def read_schedule(path: Path) -> tuple[int, list[Fault]]:
    """A schedule file, or a report holding one (``schedule``)."""
    data = json.loads(path.read_text())
    data = data.get("schedule", data)
    return int(data["seed"]), [Fault(**f) for f in data["faults"]]


# -- the runs' configuration ----------------------------------------------------------------
def run_config(args: argparse.Namespace, run_id: str, seed: int, data: Path, model: Path,
               output_dir: Path) -> dict:
    return {
        "run_id": run_id, "output_dir": str(output_dir),
        "data": {"path": str(data), "dev_fraction": 0.2,
                 # --passages max: documents as MaxP passages (data.passages), two at most.
                 "passages": ({"mode": "max", "max_passages": 2} if args.passages == "max"
                              else {"mode": "first"})},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32},
        "training": {"steps": args.steps, "batch_size": 8, "refresh_every": args.refresh_every,
                     "learning_rate": 5e-4, "torch_threads": 1, "seed": seed,
                     "processes": args.trainer_processes},
        "negatives": {"pool": "ann", "warmup": "none", "top_k": 20, "wait_for_first": True},
        "inference": {"replicas": args.replicas, "shard_size": args.shard_size,
                      "torch_threads": 1, "claim_timeout_s": args.claim_timeout},
        "index": {"eval_depth": 100, "partitions": args.partitions},
        # Every refresh's shards and tables are kept so that all of them can be checked;
        # checkpoints (the bulk of the bytes) are bounded.
        "store": {"keep_checkpoints": 2},
        # Short back-offs and a budget no nemesis of this rate exhausts: a crash loop of a
        # real bug still ends the run (a service crashing at every start is restarted at most
        # max_restarts times within window_s).
        "services": {"restart": {"initial_backoff_s": 0.5, "max_backoff_s": 4.0,
                                 "reset_after_s": 30.0, "max_restarts": 40,
                                 "window_s": 600.0}},
        "tracking": {"report_to": []},
    }


# -- the worker: one run ----------------------------------------------------------------------
class Nemesis:
    """Injects the schedule into a running :class:`EmbeddedRun` and measures recoveries."""

    def __init__(self, run, proxy, faults: list[Fault]) -> None:
        from ance_train.infra.bus import EventBus

        self.run, self.proxy, self.faults = run, proxy, faults
        self.records: list[dict] = []
        self.stopped: set[tuple[int, bool]] = set()  # (pid, whole group) frozen now
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="nemesis", daemon=True)
        self._threads: list[threading.Thread] = []  # one per fault: spells overlap
        self._bus = EventBus(_quick_redis(run.redis.port), run.config.run_id)

    def start(self) -> Nemesis:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def finish(self) -> None:
        """No more faults; thaw what is frozen, reopen the store."""
        self._done.set()
        self._thread.join(timeout=60)
        for thread in self._threads:
            thread.join(timeout=60)
        with self._lock:
            for pid, group in self.stopped:
                _signal(pid, group, signal.SIGCONT)
            self.stopped.clear()
        self.proxy.restore()
        self.proxy.fast()

    def _loop(self) -> None:
        for number, fault in enumerate(self.faults):
            if self._done.wait(max(0.0, self.started + fault.at_s - time.monotonic())):
                return
            record = {"number": number, **asdict(fault),
                      "injected_at_s": round(time.monotonic() - self.started, 2)}
            with self._lock:
                self.records.append(record)
            thread = threading.Thread(target=self._inject_safely, args=(fault, record),
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _inject_safely(self, fault: Fault, record: dict) -> None:
        try:
            self._inject(fault, record)
        except Exception as error:  # a failed injection is reported, never fatal
            record["outcome"] = f"injection failed: {error!r}"

    def _child(self, name: str):
        return next(c for c in self.run.children if c.name == name)

    def _inject(self, fault: Fault, record: dict) -> None:
        if fault.kind in ("kill", "stop"):
            rank = (int(fault.target.removeprefix(RANK_TARGET))
                    if fault.target.startswith(RANK_TARGET) else None)
            child = self._child("trainer" if rank is not None else fault.target)
            pid = child.process.pid if rank is None else rank_pid(child.process.pid, rank)
            if child.process.poll() is not None or pid is None:
                record["outcome"] = "skipped: the process was down (restarting or finished)"
                return
            record["pid"] = pid
            group = rank is None  # a service: its process group; a rank: that process only

            def back() -> bool:
                if rank is None:
                    return _answers(child, other_than=pid if fault.kind == "kill" else None)
                replaced = rank_pid(child.process.pid, rank)
                return (replaced is not None and (fault.kind == "stop" or replaced != pid)
                        and _answers(child))

            if fault.kind == "kill":
                _signal(pid, group, signal.SIGKILL)
                record["outcome"] = "killed"
                self._probe(record, time.monotonic(), back)
            else:
                _signal(pid, group, signal.SIGSTOP)
                with self._lock:
                    self.stopped.add((pid, group))
                thawed = self._done.wait(fault.duration_s)
                with self._lock:
                    self.stopped.discard((pid, group))
                _signal(pid, group, signal.SIGCONT)
                record["outcome"] = "stopped, continued" + (" (run ended)" if thawed else "")
                self._probe(record, time.monotonic(), back)
        elif fault.kind == "redis":
            self.run.redis.process.kill()
            record["outcome"] = "killed"
            port = self.run.redis.port
            self._probe(record, time.monotonic(), lambda: _redis_answers(port))
        elif fault.kind == "cut":
            self.proxy.cut()
            self._done.wait(fault.duration_s)
            self.proxy.restore()
            record["outcome"] = f"cut ({self.proxy.rejected} connections refused so far)"
            self._probe(record, time.monotonic(), lambda: True)
        else:
            self.proxy.slow(fault.delay_s)
            self._done.wait(fault.duration_s)
            self.proxy.fast()
            record["outcome"] = "slowed"
            self._probe(record, time.monotonic(), lambda: True)

    def _probe(self, record: dict, since: float, back) -> None:
        """On a thread: seconds from ``since`` until ``back()`` (the component answers:
        ``recovered_s``) and until the run next progressed (a stream entry added or the
        trainer's step advanced: ``progress_s``)."""
        before = self._progress()

        def watch() -> None:
            recovered = progressed = None
            deadline = since + 600
            while time.monotonic() < deadline and (recovered is None or progressed is None):
                now = time.monotonic()
                if recovered is None and _safe(back):
                    recovered = round(now - since, 2)
                if progressed is None and self._progress() > before:
                    progressed = round(now - since, 2)
                if self.run.finished or self._done.is_set():
                    break
                time.sleep(0.2)
            record["recovered_s"], record["progress_s"] = recovered, progressed

        threading.Thread(target=watch, daemon=True).start()

    def _progress(self) -> int:
        """Entries of the run's progress streams plus the trainer's step: both only grow."""
        from ance_train.protocol.events import EvalCompleted, PartitionSearched, ShardEncoded

        total = 0
        for event_type in (ShardEncoded, PartitionSearched, EvalCompleted):
            total += _safe(lambda t=event_type: self._bus.client.xlen(self._bus.stream(t))) or 0
        step = _safe(lambda: _status(self.run.trainer).step) or 0
        return total + int(step)


def _safe(call):
    try:
        return call()
    except Exception:
        return None


def _signal(pid: int, group: bool, signum: signal.Signals) -> None:
    """``pid``'s process group (the launcher starts each service in a session of its own:
    its group is its pid) or, for one trainer rank, that process alone."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def _status(child):
    from ance_train.infra.rpc import fetch_status

    return fetch_status(child.address, timeout_s=0.5)


def _answers(child, other_than: int | None = None) -> bool:
    if other_than is not None and child.process.pid == other_than:
        return False
    return _safe(lambda: _status(child)) is not None


def _quick_redis(port: int):
    """A client that fails fast (the nemesis must not block while Redis is down)."""
    import redis

    from ance_train.infra.credentials import redis_password

    return redis.Redis(host="127.0.0.1", port=port, password=redis_password(),
                       decode_responses=True, socket_timeout=1, socket_connect_timeout=1)


def _redis_answers(port: int) -> bool:
    return bool(_safe(lambda: _quick_redis(port).ping()))


def run_worker(spec_path: Path) -> int:
    """One run (``--worker SPEC``): writes its result next to the spec."""
    from ance_train.config import parse_config
    from ance_train.launcher.embedded import EmbeddedRun, RunAborted

    from ance_train_dev.tcp_proxy import TcpProxy

    spec = json.loads(spec_path.read_text())
    host, port = spec["s3"]["ANCE_S3_ENDPOINT"].split(":")
    proxy = TcpProxy(host, int(port)).start()
    os.environ.update({**spec["s3"], "ANCE_S3_ENDPOINT": proxy.endpoint,
                       "ANCE_S3_RETRY_SECONDS": "300"})
    config = parse_config(spec["config"], "<chaos>")
    config_path = spec_path.with_suffix(".yaml")
    result: dict = {"run_id": config.run_id, "role": spec["role"], "seed": spec["seed"],
                    "passages": config.data.passages.mode}
    run = EmbeddedRun(config, config_path, overwrite=True)
    run.prepare()
    nemesis = None
    started = time.monotonic()
    try:
        run.start_services()
        if spec["role"] == "chaos":
            nemesis = Nemesis(run, proxy, [Fault(**f) for f in spec["faults"]]).start()
        evaluations = []
        try:
            for entry in run.refreshes():
                evaluations.append(entry)
                print(f"[{config.run_id}] checkpoint {entry['step']} evaluated after "
                      f"{entry['elapsed_s']:.0f} s", flush=True)
            result["finished"] = True
        except RunAborted as error:
            result["finished"], result["error"] = False, str(error)
        result["wall_s"] = round(time.monotonic() - started, 1)
        if nemesis is not None:
            nemesis.finish()
        result["evaluations"] = [{"step": e["step"], "metrics": e["metrics"]}
                                 for e in evaluations]
        if result["finished"]:
            result["checks"] = run_checks(run)
    finally:
        if nemesis is not None:
            nemesis.finish()
        try:
            run.stop()
            result["restarts"] = run.supervisor.records()
            if nemesis is not None:
                time.sleep(1)  # the last probes write their figures
                result["faults"] = nemesis.records
            result.setdefault("checks", {}).update(after_stop_checks(run))
        finally:
            proxy.close()
    spec_path.with_suffix(".result.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


# -- the checks -------------------------------------------------------------------------------
def _check(ok: bool, detail: object = "") -> dict:
    return {"ok": bool(ok), "detail": detail}


def run_checks(run) -> dict:
    """What must hold once the run finished (its Redis and store still up)."""
    import numpy as np

    from ance_train.data.dataset import load_dataset_index
    from ance_train.infra.bus import EventBus, connect
    from ance_train.negatives.table import PAD, NegativesTable
    from ance_train.protocol import keys
    from ance_train.protocol.embeddings import unpack_embeddings, unpack_passages
    from ance_train.protocol.events import (
        CheckpointPublished,
        EvalCompleted,
        NegativesReady,
        ShardEncoded,
    )
    from ance_train.protocol.tables import TableId
    from ance_train.protocol.work import CORPUS

    cfg, store = run.config, run.store
    bus = EventBus(connect(run.redis_url), cfg.run_id)
    dataset = load_dataset_index(run.run_dir / "cache")
    checks: dict[str, dict] = {}

    # The BM25 warm-up's negatives.ready has no checkpoint (step None): not a refresh.
    announced = {t.__name__: Counter(e.step for e in bus.history(t) if e.step is not None)
                 for t in (NegativesReady, EvalCompleted)}
    twice = {name: {s: n for s, n in c.items() if n > 1} for name, c in announced.items()}
    steps = sorted(announced["NegativesReady"])
    checks["each refresh announced once"] = _check(
        not any(twice.values()) and set(steps) == set(announced["EvalCompleted"]),
        {"refreshes": steps, "announced more than once": twice})

    plans = {e.step: e.event.plan for e in bus.history(CheckpointPublished)}
    encoded: dict[int, set] = {}
    for e in bus.history(ShardEncoded):
        encoded.setdefault(e.step, set()).add(e.event.key)
    problems = []
    for step in steps:
        plan = plans.get(step)
        if plan is None:
            problems.append(f"{step}: no checkpoint.published")
            continue
        expected = plan.expected_keys()
        if not expected <= encoded.get(step, set()):
            problems.append(f"{step}: shards without shard.encoded: "
                            f"{sorted(expected - encoded.get(step, set()))[:3]}")
        stored = set(store.list(keys.embeddings(step)))
        if stored != expected:
            problems.append(f"{step}: stored shards differ: missing "
                            f"{sorted(expected - stored)[:3]}, "
                            f"extra {sorted(stored - expected)[:3]}")
            continue
        corpus = [store.get_bytes(key) for key in sorted(expected) if f"/{CORPUS}-" in key]
        ids = np.concatenate([unpack_embeddings(data)[0] for data in corpus])
        passages = [unpack_passages(data) for data in corpus]
        if all(p is not None for p in passages):  # MaxP: each (document, passage) once
            numbers = np.concatenate(passages)  # type: ignore[arg-type]
            pairs = np.unique(np.stack([ids, numbers]), axis=1)
            every_first = np.array_equal(np.sort(ids[numbers == 0]),
                                         np.arange(dataset.num_docs))
            if pairs.shape[1] != len(ids) or not every_first:
                problems.append(f"{step}: corpus rows are not every passage of every "
                                "document once")
        elif not np.array_equal(np.sort(ids), np.arange(dataset.num_docs)):
            problems.append(f"{step}: corpus rows are not every document once")
    checks["every refresh has every corpus document exactly once"] = _check(
        not problems, problems or f"{len(steps)} refreshes, {dataset.num_docs} documents each")

    positives_found = []
    for step in steps:
        table = NegativesTable.from_bytes(store.get_bytes(TableId.ann(step).key))
        for qid, row in zip(table.query_ids, table.candidates, strict=True):
            if set(dataset.train[str(qid)]) & set(row[row != PAD].tolist()):
                positives_found.append((step, str(qid)))
    checks["no negatives table holds a positive of its query"] = _check(
        not positives_found, positives_found[:5] or f"{len(steps)} tables")

    summary = store.get_json(keys.TRAINER_SUMMARY)
    total = cfg.training.total_steps
    per_step = {name: len(value) for name, value in summary.items()
                if isinstance(value, list) and name in PER_STEP}
    checks["every training step recorded once"] = _check(
        summary.get("finished") and summary.get("steps") == total
        and all(n == total for n in per_step.values()),
        {"steps": summary.get("steps"), "per-step lists": per_step,
         "resumed_from": summary.get("resumed_from")})

    # The run ends when the final checkpoint is evaluated; items of a superseded checkpoint
    # (never announced) may still be pending then, and are no loss.
    pending = pending_steps(bus)
    of_announced = [step for step in pending if step in set(steps)]
    dead = bus.client.xlen(bus.key(keys.DEAD_LETTER_STREAM))
    checks["no work item of an announced refresh pending, nothing dead-lettered"] = _check(
        not of_announced and dead == 0,
        {"pending items (their checkpoints)": pending, "dead-lettered": dead})
    return checks


def pending_steps(bus) -> list[int]:
    """The checkpoint of every work item delivered and not acknowledged."""
    from ance_train.protocol import keys

    stream = bus.key(keys.WORK_STREAM)
    steps = []
    for group in bus.client.xinfo_groups(stream):
        for entry in bus.client.xpending_range(stream, group["name"], "-", "+", 10000):
            for _, fields in bus.client.xrange(stream, entry["message_id"], entry["message_id"]):
                steps.append(int(json.loads(fields["data"])["step"]))
    return sorted(steps)


# Lists of TrainingRecord with one entry per step (trainer/trainer.py, summary()).
PER_STEP = ("losses", "dual_losses", "hard_negatives", "async_gaps", "negatives_steps",
            "step_seconds", "negatives_ms", "prepare_ms", "prepare_wait_ms")


def expected_redis_names(run) -> set[str]:
    """Every key the run's services may leave in its Redis namespace."""
    from ance_train.protocol import keys
    from ance_train.protocol.message import Message

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    names = {getattr(cls, "TYPE", None) for cls in subclasses(Message)}
    names |= {keys.WORK_STREAM, keys.DEAD_LETTER_STREAM, keys.LATEST_CHECKPOINT,
              keys.REFRESH_UNDER_WAY}
    names |= {keys.service_registration(c.role, c.name) for c in run.children}
    names |= {keys.index_partition_address(p) for p in range(run.config.index.partitions)}
    names.discard(None)
    return {keys.redis_key(run.config.run_id, n) for n in names}


def after_stop_checks(run) -> dict:
    """Once the launcher stopped everything: no process left, no stray Redis key (the AOF
    read by a fresh server), no temporary object in the run's part of the store."""
    from ance_train.launcher.redis_server import RedisServer

    from ance_train_dev.service_harness import processes_mentioning

    checks = {}
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(run.run_dir))) and time.monotonic() < deadline:
        time.sleep(0.5)
    redis_left = processes_mentioning(f"127.0.0.1:{run.redis.port}")
    checks["no service process left"] = _check(not left and not redis_left,
                                               left + redis_left or "none")
    with RedisServer(run.redis.directory) as server:  # a new port, the same AOF
        import redis

        client = redis.Redis.from_url(server.url, decode_responses=True)
        found = set(client.scan_iter("*"))
    stray = sorted(found - expected_redis_names(run))
    checks["no Redis key beyond the run's own"] = _check(
        not stray, stray[:10] or f"{len(found)} keys, all the run's")
    temporary = [k for k in run.store.list() if ".tmp" in k or "/tmp-" in k or k.endswith("~")]
    checks["no temporary object in the store"] = _check(not temporary, temporary[:10] or "none")
    return checks


# -- the parent -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long the nemesis injects faults (at most; it stops when the "
                             "chaos run finishes)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--faults", type=int, default=None, help="at most this many faults")
    parser.add_argument("--replay", type=Path, help="a schedule (or report) to inject again")
    parser.add_argument("--data", default="subset",
                        help="subset (300 SciFact documents), scifact (all 5,183) or a BEIR dir")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--refresh-every", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--trainer-processes", type=int, default=1)
    parser.add_argument("--shard-size", type=int, default=50)
    parser.add_argument("--passages", choices=("first", "max"), default="first",
                        help="data.passages.mode of the runs: first (FirstP) or max (MaxP "
                             "passages, at most 2 per document)")
    parser.add_argument("--claim-timeout", type=float, default=5.0)
    parser.add_argument("--baseline-seeds", type=int, default=2,
                        help="undisturbed runs: seed, seed+1, ... (the first is the reference)")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="the least allowed |chaos − baseline| of nDCG@10 (the noise of "
                             "the baseline seeds, if larger, is allowed)")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary dir")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="chaos")
    parser.add_argument("--reliability", default=str(REPO / "docs" / "reliability.md"),
                        help="document whose chaos section is replaced ('': none)")
    parser.add_argument("--render", type=Path,
                        help="publish a saved report again (with --notes), run nothing")
    parser.add_argument("--notes", help="markdown appended to the report and the section")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _data_dir(choice: str, work: Path) -> Path:
    if choice == "subset":
        from ance_train_dev.helpers import make_scifact_subset

        return make_scifact_subset(work / "data")
    if choice == "scifact":
        return SCIFACT
    return Path(choice)


def launch_workers(args: argparse.Namespace, work: Path, s3_env: dict, data: Path,
                   model: Path, seed: int, faults: list[Fault]) -> list[dict]:
    """The chaos run and the baselines, side by side; their results."""
    runs = [("chaos", seed), *(("baseline", seed + i) for i in range(args.baseline_seeds))]
    processes = []
    for role, run_seed in runs:
        run_id = f"{role}-s{run_seed}"
        spec = {"role": role, "seed": run_seed, "s3": s3_env,
                "faults": [asdict(f) for f in faults] if role == "chaos" else [],
                "config": run_config(args, run_id, run_seed, data, model, work / "runs")}
        spec_path = work / f"{run_id}.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        log = open(work / f"{run_id}.log", "wb")  # noqa: SIM115 - closed below
        processes.append((spec_path, log, subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "chaos.py"), "--worker", str(spec_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
    results = []
    try:
        codes = [process.wait() for _, _, process in processes]
    finally:  # stopped (SIGTERM, Ctrl-C) or failed: each worker stops its run (its finally)
        for _, _, process in processes:
            if process.poll() is None:
                process.terminate()
        for _, log, process in processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    for (spec_path, _, _), code in zip(processes, codes, strict=True):
        out = spec_path.with_suffix(".result.json")
        if code != 0 or not out.exists():
            tail = spec_path.with_suffix(".log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"worker {spec_path.stem} exited {code}:\n{tail}")
        results.append(json.loads(out.read_text()))
    return results


def store_leftovers(s3_env: dict) -> list[str]:
    """Unfinished multipart uploads in the bucket (boto3 against the S3 server directly)."""
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://{s3_env['ANCE_S3_ENDPOINT']}",
                          aws_access_key_id=s3_env["ANCE_S3_ACCESS_KEY"],
                          aws_secret_access_key=s3_env["ANCE_S3_SECRET_KEY"],
                          region_name="us-east-1")
    uploads = client.list_multipart_uploads(Bucket=s3_env["ANCE_S3_BUCKET"])
    return [u["Key"] for u in uploads.get("Uploads", [])]


def final_ndcg(result: dict) -> dict[str, float]:
    last = result["evaluations"][-1]["metrics"]
    return {split: round(values["ndcg@10"], 4) for split, values in last.items()}


def compare(chaos: dict, baselines: list[dict], tolerance: float) -> dict:
    """The chaos run's final nDCG@10 against the same seed's baseline, within the noise."""
    reference = final_ndcg(baselines[0])
    finals = [final_ndcg(b) for b in baselines]
    noise = {split: max((abs(a[split] - b[split]) for a, b in itertools.combinations(finals, 2)),
                        default=0.0) for split in reference}
    allowed = {split: round(max(noise[split], tolerance), 4) for split in reference}
    got = final_ndcg(chaos)
    diff = {split: round(abs(got[split] - reference[split]), 4) for split in reference}
    return {"chaos": got, "baseline": reference, "baseline seeds": finals, "noise": noise,
            "allowed": allowed, "diff": diff,
            "ok": all(diff[s] <= allowed[s] + 1e-9 for s in reference)}


def summarise_faults(records: list[dict]) -> dict:
    by_kind: dict[str, dict] = {}
    for kind in KINDS:
        rows = [r for r in records if r["kind"] == kind]
        recovered = [r["recovered_s"] for r in rows if r.get("recovered_s") is not None]
        progress = [r["progress_s"] for r in rows if r.get("progress_s") is not None]
        by_kind[kind] = {
            "injected": sum(1 for r in rows if not r.get("outcome", "").startswith("skipped")),
            "skipped": sum(1 for r in rows if r.get("outcome", "").startswith("skipped")),
            "recovered median s": statistics.median(recovered) if recovered else None,
            "recovered max s": max(recovered) if recovered else None,
            "progress median s": statistics.median(progress) if progress else None,
            "progress max s": max(progress) if progress else None}
    return by_kind


def render(report: dict) -> str:
    chaos, quality = report["chaos"], report["quality"]
    faults = report["faults by kind"]
    restarts = Counter(r["service"] for r in chaos["restarts"])
    host = report["machine"]
    lines = [
        "## Chaos soak (`bench/chaos.py`)",
        "",
        f"One embedded run ({report['setup']}) under a seeded nemesis for "
        f"{report['nemesis_minutes']:g} min at most, beside {len(report['baselines'])} "
        "undisturbed runs of the same configuration (seeds "
        f"{', '.join(str(b['seed']) for b in report['baselines'])}; the first is the "
        "reference). Faults every 3–10 s: SIGKILL of a service's processes, SIGSTOP for 1 s "
        f"to 2 × claim_timeout_s ({report['claim_timeout_s']:g} s) then SIGCONT, Redis "
        "SIGKILLed (the launcher restarts it on its port and AOF), the store's proxy "
        "resetting every connection for 2–20 s, or holding every chunk 50–500 ms for "
        "5–30 s. *Recovered*: from the kill (or the end of a stop, cut or slow spell) until "
        "the component answers again (gRPC Status of the new process, Redis PING; the store "
        "at once); *progress*: until the run next moved (a stream entry or a trainer step).",
        "",
        "| fault | injected | skipped (target down) | recovered median / max s "
        "| progress median / max s |",
        "|---|---|---|---|---|",
    ]
    for kind, row in faults.items():
        lines.append(f"| {kind} | {row['injected']} | {row['skipped']} | "
                     f"{_num(row['recovered median s'])} / {_num(row['recovered max s'])} | "
                     f"{_num(row['progress median s'])} / {_num(row['progress max s'])} |")
    lines += [
        "",
        f"- faults scheduled {report['faults scheduled']}, injected before the run finished "
        f"{report['faults injected']}; restarts by the launcher: {len(chaos['restarts'])} ("
        + (", ".join(f"{k} ×{v}" for k, v in sorted(restarts.items())) or "none") + ")",
        f"- wall time: chaos {chaos['wall_s']:.0f} s, baseline (same seed, side by side) "
        f"{report['baselines'][0]['wall_s']:.0f} s: **{report['time lost s']:+.0f} s** lost",
        f"- final nDCG@10 chaos {quality['chaos']} vs baseline {quality['baseline']}: "
        f"|diff| {quality['diff']}, allowed {quality['allowed']} (noise between the "
        f"baseline seeds {quality['noise']}, at least --tolerance {report['tolerance']:g})"
        f": **{'within' if quality['ok'] else 'OUTSIDE'}**",
        "",
        "| check | chaos | baselines |",
        "|---|---|---|",
    ]
    for name, check in chaos["checks"].items():
        base = all(b["checks"].get(name, {}).get("ok") for b in report["baselines"])
        lines.append(f"| {name} | {'pass' if check['ok'] else 'FAIL: ' + str(check['detail'])}"
                     f" | {'pass' if base else 'FAIL'} |")
    lines += [
        f"| no unfinished multipart upload in the bucket | "
        f"{'pass' if not report['multipart leftovers'] else 'FAIL'} | (same bucket) |",
        "",
        f"**Lost: {report['lost']}.** Every check passed: **{report['passed']}**.",
        "",
        f"Date {report['date']}, command `{report['command']}` (seed {report['seed']}; the "
        "schedule is in the JSON report, `--replay` takes it), machine: "
        f"{host['cpu']} ({host['cores']} cores, flags {' '.join(host['cpu_flags'])}"
        f", {host['platform']}), load average (1 min) {report['load before']:.1f} "
        f"before and {report['load after']:.1f} after; the machine was shared with other "
        "runs, so wall times are noisy. The chaos and baseline runs share its cores.",
        "",
    ]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the parent stops its workers, each worker its run.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if args.worker is not None:
        return run_worker(args.worker)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        publish(args, report)
        return 0 if report["passed"] else 1
    from ance_train_dev.servers import moto_server
    from ance_train_dev.synthetic import make_tiny_bert

    date, load_before = utc_now(), os.getloadavg()[0]
    services = service_names(args.replicas, args.partitions, args.trainer_processes)
    if args.replay:
        seed, faults = read_schedule(args.replay)
    else:
        seed = args.seed
        faults = make_schedule(seed, args.minutes, services, args.claim_timeout, args.faults)
    schedule = schedule_json(seed, faults)
    print(json.dumps(schedule, indent=1), flush=True)
    with tempfile.TemporaryDirectory(prefix="ance-chaos-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "schedule.json").write_text(json.dumps(schedule, indent=1))
        data = _data_dir(args.data, work)
        model = make_tiny_bert(work / "tiny-bert")
        with moto_server() as s3_env:
            results = launch_workers(args, work, s3_env, data, model, seed, faults)
            leftovers = store_leftovers(s3_env)
    chaos, baselines = results[0], results[1:]
    lost = [f"{r['run_id']}: {name}" for r in results
            for name, check in r.get("checks", {}).items() if not check["ok"]]
    lost += [f"{r['run_id']}: did not finish ({r.get('error', '')[:300]})"
             for r in results if not r.get("finished")]
    if leftovers:
        lost.append(f"multipart uploads left: {leftovers[:5]}")
    quality = (compare(chaos, baselines, args.tolerance)
               if all(r.get("finished") for r in results) else {"ok": False})
    records = chaos.get("faults", [])
    report = {
        "date": date, "command": command_line(), "seed": seed, "schedule": schedule,
        "setup": (f"{args.data} data, tiny random BERT, {args.steps} steps, checkpoint every "
                  f"{args.refresh_every}, {args.replicas} inferencers, {args.partitions} index "
                  f"partitions, {args.trainer_processes} trainer process(es), S3 (moto) "
                  "through a TCP proxy"),
        "nemesis_minutes": args.minutes, "claim_timeout_s": args.claim_timeout,
        "tolerance": args.tolerance, "faults scheduled": len(faults),
        "faults injected": sum(1 for r in records
                               if not r.get("outcome", "").startswith("skipped")),
        "faults by kind": summarise_faults(records), "chaos": chaos, "baselines": baselines,
        "time lost s": round(chaos.get("wall_s", 0) - baselines[0].get("wall_s", 0), 1),
        "quality": quality, "multipart leftovers": leftovers,
        "lost": "; ".join(lost) if lost else "nothing",
        "passed": not lost and quality.get("ok", False),
        "machine": machine(), "load before": load_before, "load after": os.getloadavg()[0],
    }
    if not report["passed"] and not lost:
        report["lost"] = "nothing, but the final metrics are outside the noise"
    publish(args, report)
    print(f"passed: {report['passed']}", flush=True)
    return 0 if report["passed"] else 1


def publish(args: argparse.Namespace, report: dict) -> None:
    """``<out>/<name>.{json,md}`` and the chaos section of docs/reliability.md, with the
    ``--notes`` (what a soak found, written by hand) after the figures."""
    if args.notes:
        report["notes"] = Path(args.notes).read_text()
    finished = all(r.get("finished") for r in (report["chaos"], *report["baselines"]))
    markdown = render(report) if finished else (
        f"## Chaos soak\n\nA run did not finish: {report['lost']}\n")
    if report.get("notes"):
        markdown += "\n" + report["notes"].rstrip("\n") + "\n"
    write_report(args.out, args.name, report, markdown)
    if args.reliability:
        doc = Path(args.reliability)
        doc.write_text(SECTION.splice(doc.read_text() if doc.exists() else "", markdown))
