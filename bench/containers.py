"""The chart's pods as real containers: images built, a run to completion, what operators do.

Runs on a machine with podman (scripts/containers/engine.sh) and the dev extras, as root:

    python bench/containers.py                 # build the images, then every phase below
    python bench/containers.py --skip-build    # use the images already built

Phases, each written into ``docs/benchmarks/containers.{json,md}``:

1. **Images.** ``scripts/build_image.sh`` for the Debian base, the CPU image, Redis and the S3
   stand-in: build time, size, and what dominates the size. The CPU image then runs
   ``ance-train --help``, ``ance-train validate`` and a short embedded run, each as the non-root
   user with a read-only root file system (the chart's security context).
2. **The chart, played** (``scripts/containers/play_chart.py`` with
   ``helm/examples/values-local.yaml``): a run on a SciFact subset to completion, one
   inferencer pod. Every refresh evaluated; the invariants of the chaos soak checked on the
   run's own Redis and store (bench/chaos.py:run_checks).
3. **Operators' actions** on a second such run: inferencers 1 -> 3 mid-run, then an inferencer
   pod, the indexer pod and the trainer pod killed in turn (each replaced by its controller's
   stand-in); refresh periods before and after, recovery times, the same invariants.
4. **The embedded run** of the same configuration on this machine, for the metrics.

Traffic goes to loopback and to the pods' addresses on the network play_chart.py creates.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import yaml

from ance_train_dev.chaos import run_checks
from ance_train_dev.helpers import make_scifact_subset
from ance_train_dev.report import command_line, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]
PLAY = [sys.executable, str(REPO / "scripts" / "containers" / "play_chart.py")]
VALUES = REPO / "helm" / "examples" / "values-local.yaml"
RELEASE = "ance-train"
CPU_IMAGE = "localhost/ance-train:0.1.0-cpu"


def sh(*args: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), text=True, capture_output=True, timeout=timeout,
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}\n{done.stdout[-2000:]}"
                           f"\n{done.stderr[-4000:]}")
    return done


def engine(*args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    script = f'. "{REPO}/scripts/containers/engine.sh"; engine "$@"'
    return sh("bash", "-c", script, "engine", *args, check=check, timeout=timeout)


def play(*args: str, timeout: float = 900) -> str:
    return sh(*PLAY, *args, timeout=timeout).stdout


# ----------------------------------------------------------------------------- images


def build_images() -> dict[str, Any]:
    built = {}
    for target in ("base", "cpu", "redis", "s3"):
        start = time.monotonic()
        sh("bash", str(REPO / "scripts" / "build_image.sh"), target, timeout=3600)
        seconds = time.monotonic() - start
        record = REPO / "build" / "images" / f"{target}.json"
        built[target] = (json.loads(record.read_text()) if target != "base"
                         else {"build_seconds": round(seconds)})
        built[target]["wall_seconds"] = round(seconds, 1)
    return built


def image_breakdown(image: str) -> list[dict[str, Any]]:
    """The largest installed packages and system folders of an image (MB)."""
    script = ("du -sm /usr/local/lib/python3*/dist-packages/* /usr/lib/python3* "
              "/usr/lib/x86_64-linux-gnu /usr/share 2>/dev/null | sort -rn | head -12")
    out = engine("run", "--rm", "--entrypoint", "sh", image, "-c", script).stdout
    rows = []
    for line in out.splitlines():
        size, path = line.split("\t", 1)
        rows.append({"path": path, "mb": int(size)})
    return rows


def restricted_run(image: str, *args: str, mounts: tuple[str, ...] = ()) -> dict[str, Any]:
    """The image as the chart runs it: uid 10001, read-only root, tmpfs /tmp and /work."""
    volumes = [f"--volume={m}" for m in mounts]
    start = time.monotonic()
    # Folders owned by uid 10001, as the chart's emptyDirs are to the pod's fsGroup (a podman
    # tmpfs mount stayed root-owned whatever its mode option).
    scratch = Path(tempfile.mkdtemp(prefix="ance-scratch-"))
    for name in ("work", "tmp"):
        (scratch / name).mkdir()
        os.chown(scratch / name, 10001, 10001)
    done = engine("run", "--rm", "--read-only", "--user", "10001:10001",
                  f"--volume={scratch / 'tmp'}:/tmp", f"--volume={scratch / 'work'}:/work",
                  "--network", "none", *volumes, image, *args,
                  check=False, timeout=1800)
    return {"command": "ance-train " + " ".join(args), "exit": done.returncode,
            "seconds": round(time.monotonic() - start, 1),
            "tail": (done.stdout + done.stderr).strip().splitlines()[-6:]}


def image_checks(dataset: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    inside = copy.deepcopy(config)
    inside["data"]["path"] = "/data"
    inside["output_dir"] = "/work/runs"
    inside["training"]["steps"] = 10
    inside["training"]["refresh_every"] = 5
    inside.setdefault("inference", {})["replicas"] = 1
    folder = Path(tempfile.mkdtemp(prefix="ance-image-check-"))
    (folder / "config.yaml").write_text(yaml.safe_dump(inside))
    os.chmod(folder, 0o755)
    mounts = (f"{dataset}:/data:ro", f"{folder}:/etc/ance:ro")
    return [restricted_run(CPU_IMAGE, "--help"),
            restricted_run(CPU_IMAGE, "validate", "--config", "/etc/ance/config.yaml",
                           mounts=mounts),
            restricted_run(CPU_IMAGE, "run", "--config", "/etc/ance/config.yaml",
                           mounts=mounts)]


# ----------------------------------------------------------------------------- the run


class PlayedRun:
    """One release played by play_chart.py, and the reads an operator's tools would make."""

    def __init__(self, dataset: Path, values: list[str], run_id: str) -> None:
        self.dataset, self.run_id = dataset, run_id
        self.values = [*values, f"run.id={run_id}"]

    def up(self, before_workloads=None) -> dict[str, Any]:
        play("down")
        sets = [arg for value in self.values for arg in ("--set", value)]
        if before_workloads is None:
            play("up", "--values", str(VALUES), *sets, "--dataset", str(self.dataset))
        else:  # the store first, then what must be in it, then the release's pods
            play("up", "--values", str(VALUES), *sets, "--dataset", str(self.dataset),
                 "--only-store")
            before_workloads()
            play("up", "--values", str(VALUES), *sets, "--skip-store")
        state = json.loads((REPO / "build" / "containers" / RELEASE / "up.json").read_text())
        self._connect()
        return state

    def _connect(self) -> None:
        from ance_train.config import parse_config
        from ance_train.infra.store.s3 import S3Store

        docs = trainer_pod_manifests()
        trainer = docs["Pod"]
        env = {e["name"]: e["value"] for e in trainer["spec"]["containers"][0]["env"]}
        hosts = {name: alias["ip"] for alias in trainer["spec"]["hostAliases"]
                 for name in alias["hostnames"]}
        s3_host, _, s3_port = env["ANCE_S3_ENDPOINT"].partition(":")
        redis_host = env["ANCE_REDIS_URL"].split("//")[1].split(":")[0]
        raw = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])
        self.config = parse_config(raw)
        self.raw_config = raw
        self.store = S3Store(self.run_id, f"{hosts[s3_host]}:{s3_port}",
                             env["ANCE_S3_ACCESS_KEY"], env["ANCE_S3_SECRET_KEY"],
                             env["ANCE_S3_BUCKET"], create_bucket=False)
        self.redis_url = f"redis://:{env['ANCE_REDIS_PASSWORD']}@{hosts[redis_host]}:6379/0"

    def bus(self):
        from ance_train.infra.bus import EventBus, connect

        return EventBus(connect(self.redis_url), self.run_id)

    def trainer_state(self) -> tuple[str, int]:
        done = engine("inspect", f"{RELEASE}-trainer-0-trainer", "--format",
                      "{{.State.Status}} {{.State.ExitCode}}", check=False)
        status, _, code = done.stdout.strip().partition(" ")
        return status, int(code or 0)

    def wait_finished(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            status, code = self.trainer_state()
            if status == "exited":
                if code != 0:
                    raise RuntimeError(f"trainer exited {code}:\n{self.logs('trainer')}")
                # The indexer evaluates the final checkpoint after the trainer exits.
                final = self.config.training.total_steps
                while time.monotonic() - start < timeout_s:
                    if self.store.exists(f"eval/{final}.json"):
                        return time.monotonic() - start
                    time.sleep(2)
            time.sleep(3)
        raise RuntimeError(f"run not finished after {timeout_s:g}s")

    def wait_step(self, step: int, timeout_s: float = 900) -> None:
        from ance_train.protocol.events import CheckpointPublished

        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if any(e.step >= step for e in self.bus().history(CheckpointPublished)):
                return
            time.sleep(1)
        raise RuntimeError(f"no checkpoint {step} after {timeout_s:g}s")

    def logs(self, role: str) -> str:
        return sh(*PLAY, "logs", f"{RELEASE}-{role}-0", check=False).stdout[-3000:]

    def results(self) -> dict[str, Any]:
        from ance_train.protocol.events import CheckpointPublished, NegativesReady, ShardEncoded

        bus = self.bus()
        published = {e.step: ms(e.entry_id) for e in bus.history(CheckpointPublished)}
        ready = {e.step: ms(e.entry_id) for e in bus.history(NegativesReady)
                 if e.step is not None and e.step in published}  # not the BM25 warm-up
        shards: dict[int, list] = {}
        for e in bus.history(ShardEncoded):
            shards.setdefault(e.step, []).append(e.event)
        refreshes = []
        for step in sorted(ready):
            encoded = shards.get(step, [])
            refreshes.append({
                "step": step,
                "published_to_ready_s": round((ready[step] - published[step]) / 1000, 2),
                "encode_span_s": round(max(s.finished_at for s in encoded)
                                       - published[step] / 1000, 2) if encoded else None,
                "inferencers": len({s.instance for s in encoded}),
                "ready_unix": ready[step] / 1000})
        evaluations = []
        for step in sorted(ready):
            report = self.store.get_json(f"eval/{step}.json")
            evaluations.append({"step": step, "metrics": {
                split: round(values["ndcg@10"], 4) for split, values in report["metrics"].items()}})
        with tempfile.TemporaryDirectory() as cache:
            (Path(cache) / "cache").mkdir()
            (Path(cache) / "cache" / "dataset.json").write_bytes(
                self.store.get_bytes("data/dataset.json"))
            run = SimpleNamespace(config=self.config, store=self.store,
                                  run_dir=Path(cache), redis_url=self.redis_url)
            checks = run_checks(run)
        return {"refreshes": refreshes, "evaluations": evaluations, "checks": checks,
                "summary": {k: v for k, v in self.store.get_json("trainer/summary.json").items()
                            if not isinstance(v, list)}}


def trainer_pod_manifests() -> dict[str, dict[str, Any]]:
    """The trainer pod as play_chart.py played it (resolved env, host aliases), and the
    ConfigMap beside it, by kind."""
    path = REPO / "build" / "containers" / RELEASE / "pods" / f"{RELEASE}-trainer-0.yaml"
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}


def load_player() -> ModuleType:
    """scripts/containers/play_chart.py, loaded from its path (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("play_chart", PLAY[1])
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def upload_model(url: str) -> None:
    """The packaged encoder's folder to ``url`` in the S3 pod, as an operator would copy a
    model that is not in the image (the same copy play_chart.py makes of the dataset)."""
    from ance_train.config import default_model_path

    state = json.loads((REPO / "build" / "containers" / RELEASE / "store.json").read_text())
    load_player().upload_folder(state["address"], state["access_key"], state["secret_key"],
                                url, Path(default_model_path()))


def ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def run_plain(dataset: Path, steps: int) -> dict[str, Any]:
    run = PlayedRun(dataset, [f"run.config.training.steps={steps}"], "containers-plain")
    start = time.monotonic()
    up = run.up()
    run.wait_step(10)
    # `helm test` while the services run: the chart's hook Pod checks every gRPC health.
    hook = sh(*PLAY, "test", check=False, timeout=900)
    watch = operator_view(run)
    run.wait_finished(3600)
    wall = time.monotonic() - start  # from `up` to the final checkpoint evaluated
    out = run.results()
    out.update(up=up, wall_s=round(wall, 1),
               helm_test={"exit": hook.returncode, "output": hook.stdout.splitlines()[-12:]},
               operator_view=watch)
    pod_rows = play("pods")
    out["pods_at_end"] = pod_rows.splitlines()
    out["config"] = run.raw_config
    return out


def operator_view(run: PlayedRun) -> list[dict[str, Any]]:
    """What NOTES.txt tells an operator to run, as close as podman allows (docs/deployment.md,
    section 9, says which kubectl commands have no counterpart and why)."""
    import urllib.request

    indexer = f"{RELEASE}-indexer-0-indexer"
    views = [
        ("kubectl get pods", [*PLAY, "pods"]),
        ("kubectl logs job/ance-train-trainer", [*PLAY, "logs", f"{RELEASE}-trainer-0"]),
        ("kubectl exec deploy/ance-train-indexer -- ance-train status",
         ["bash", "-c", f'. "{REPO}/scripts/containers/engine.sh"; engine exec {indexer} '
                        f"ance-train status --run-id {run.run_id}"]),
        ("kubectl exec deploy/ance-train-indexer -- ance-train search",
         ["bash", "-c", f'. "{REPO}/scripts/containers/engine.sh"; engine exec {indexer} '
                        f'ance-train search --run-id {run.run_id} "what causes anemia"'])]
    out = []
    for name, command in views:
        done = sh(*command, check=False, timeout=120)
        out.append({"notes_command": name, "ran": " ".join(command[-6:]),
                    "exit": done.returncode,
                    "output": (done.stdout + done.stderr).strip().splitlines()[-8:]})
    trainer = trainer_pod_manifests()["Pod"]
    ip = next(e["value"] for e in trainer["spec"]["containers"][0]["env"]
              if e["name"] == "POD_IP")
    with urllib.request.urlopen(f"http://{ip}:9100/metrics", timeout=10) as response:
        metrics = [line for line in response.read().decode().splitlines()
                   if line.startswith("ance_") and not line.startswith("#")]
    out.append({"notes_command": "kubectl port-forward svc/ance-train-trainer 9100 + curl",
                "ran": f"curl http://{ip}:9100/metrics (the pod's address)", "exit": 0,
                "output": metrics[:8]})
    return out


def run_operators(dataset: Path, steps: int, refresh_every: int) -> dict[str, Any]:
    """Scale 1 -> 3 mid-run, then kill an inferencer, the indexer and the trainer in turn.
    The encoder is named by an s3:// prefix (a model that is not in the image): the trainer's
    init step copies it into the run's store, every role loads it from there."""
    model_url = "s3://ance-train/models/minilm/"
    run = PlayedRun(dataset, [f"run.config.training.steps={steps}",
                              f"run.config.model.path={model_url}"], "containers-ops")
    run.up(before_workloads=lambda: upload_model(model_url))
    actions = []
    scale_at = 2 * refresh_every
    run.wait_step(scale_at)
    t0 = time.monotonic()
    play("scale", "inferencer", "3")
    actions.append({"action": "scale inferencer 1 -> 3", "after_checkpoint": scale_at,
                    "seconds": round(time.monotonic() - t0, 1), "unix": time.time()})
    for role, at in (("inferencer-1", 4), ("indexer-0", 5), ("trainer-0", 6)):
        step = at * refresh_every
        if step >= steps:
            break
        run.wait_step(step)
        time.sleep(2)  # mid-refresh: the checkpoint's shards are being encoded
        t0 = time.monotonic()
        play("kill", f"{RELEASE}-{role}")
        actions.append({"action": f"kill {RELEASE}-{role}", "after_checkpoint": step,
                        "replace_s": round(time.monotonic() - t0, 1), "unix": time.time()})
        actions[-1]["recovered_s"] = recovery_seconds(run, role, t0)
    wall = run.wait_finished(3600)
    out = run.results()
    out.update(actions=actions, wall_s=round(wall, 1), pods_at_end=play("pods").splitlines())
    return out


def recovery_seconds(run: PlayedRun, role: str, since: float) -> float:
    """Seconds from the kill until the replaced pod's service is answering again (its gRPC
    health: the replaced service registered and serving, read with `ance-train status`)."""
    deadline = since + 600
    name = f"{RELEASE}-{role}"
    while time.monotonic() < deadline:
        done = engine("exec", f"{name}-{role.split('-')[0]}", "ance-train", "status",
                      "--run-id", run.run_id, "--json", check=False, timeout=60)
        if done.returncode == 0 and any(name in json.dumps(row) and row.get("state") != "down"
                                        for row in json.loads(done.stdout or "[]")):
            return round(time.monotonic() - since, 1)
        time.sleep(2)
    return float("nan")


# ----------------------------------------------------------------------------- embedded


def run_embedded(dataset: Path, config: dict[str, Any], run_id: str) -> dict[str, Any]:
    cfg = copy.deepcopy(config)
    cfg["run_id"] = run_id
    cfg["data"]["path"] = str(dataset)
    work = Path(tempfile.mkdtemp(prefix="ance-embedded-"))
    cfg["output_dir"] = str(work)
    cfg.setdefault("inference", {})["replicas"] = 1
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    sh(str(Path(sys.executable).parent / "ance-train"), "run", "--config", str(path),
       timeout=3600)
    wall = time.monotonic() - start
    evaluations = []
    for report in sorted(work.rglob("eval/*.json"), key=lambda p: int(p.stem)):
        metrics = json.loads(report.read_text())["metrics"]
        evaluations.append({"step": int(report.stem), "metrics": {
            split: round(values["ndcg@10"], 4) for split, values in metrics.items()}})
    return {"evaluations": evaluations, "wall_s": round(wall, 1)}


# ----------------------------------------------------------------------------- report


def agreement(containers: list[dict], embedded: list[dict]) -> dict[str, Any]:
    """Per checkpoint, |containers - embedded| of test nDCG@10. Checkpoint 0 (the unchanged
    model) must agree exactly; later ones differ by which refresh's negatives each step drew,
    which asynchronous timing decides."""
    by_step = {e["step"]: e["metrics"] for e in embedded}
    rows = []
    for e in containers:
        other = by_step.get(e["step"])
        if other:
            rows.append({"step": e["step"], **{
                f"{split}_containers": e["metrics"][split] for split in e["metrics"]},
                **{f"{split}_embedded": other[split] for split in other},
                "test_diff": round(e["metrics"]["test"] - other["test"], 4)})
    return {"rows": rows,
            "zero_shot_identical": bool(rows) and rows[0]["step"] == 0
            and rows[0]["test_diff"] == 0}


def render(report: dict[str, Any]) -> str:
    host = report["machine"]
    lines = ["# The chart's pods on real containers", "",
             f"`{report['command']}` on {host['cpu']} ({host['cores']} cores, flags "
             f"{', '.join(host['cpu_flags'])}), {report['date']}. {report['podman']}.", ""]
    for earlier in report.get("earlier_commands", []):
        lines += [f"Phases not rerun come from `{earlier['command']}`, {earlier['date']}.", ""]
    if report.get("images"):
        lines += ["## Images", "", "| image | build (s) | size (MB) |", "|---|---:|---:|"]
        for target, row in report["images"].items():
            size = row.get("size_bytes")
            lines.append(f"| {row.get('image', target)} | {row['wall_seconds']} | "
                         f"{'' if size is None else round(size / 1e6)} |")
        for target, row in report["images"].items():
            steps = sorted(row.get("steps", []), key=lambda step: -step["seconds"])[:3]
            if steps:
                lines += ["", f"Longest steps of {row.get('image', target)}:", ""]
                lines += [f"- {step['seconds']} s: `{step['step']}`" for step in steps]
        lines += ["", "Largest parts of the CPU image (MB):", ""]
        lines += [f"- `{r['path']}`: {r['mb']}" for r in report.get("breakdown", [])]
        lines.append("")
    if report.get("image_checks"):
        lines += ["## The CPU image as the chart runs it (uid 10001, read-only root)", "",
                  "| command | exit | seconds |", "|---|---:|---:|"]
        lines += [f"| `{c['command']}` | {c['exit']} | {c['seconds']} |"
                  for c in report["image_checks"]]
        lines.append("")
    for name in ("plain", "operators"):
        run = report.get(name)
        if not run:
            continue
        lines += [f"## Run `{name}`", "", f"Wall time {run['wall_s']} s.", "",
                  "| checkpoint | published -> negatives ready (s) | inferencers | "
                  "dev nDCG@10 | test nDCG@10 |", "|---:|---:|---:|---:|---:|"]
        metrics = {e["step"]: e["metrics"] for e in run["evaluations"]}
        for r in run["refreshes"]:
            m = metrics.get(r["step"], {})
            lines.append(f"| {r['step']} | {r['published_to_ready_s']} | {r['inferencers']} | "
                         f"{m.get('dev', '')} | {m.get('test', '')} |")
        lines += ["", "Checks:", ""]
        lines += [f"- {'ok' if c['ok'] else 'FAILED'}: {name_} ({c['detail']})"
                  for name_, c in run["checks"].items()]
        for view in run.get("operator_view", []):
            lines.append(f"- NOTES `{view['notes_command']}` -> `{view['ran']}`: exit "
                         f"{view['exit']}")
        if "helm_test" in run:
            lines.append(f"- `play_chart.py test` (the chart's `helm test` hook) exit "
                         f"{run['helm_test']['exit']}")
        for a in run.get("actions", []):
            lines.append(f"- action: {json.dumps(a)}")
        lines.append("")
    if report.get("agreement"):
        lines += ["## Containers against the embedded run (test nDCG@10)", "",
                  "| checkpoint | containers | embedded | difference |", "|---:|---:|---:|---:|"]
        for r in report["agreement"]["rows"]:
            lines.append(f"| {r['step']} | {r['test_containers']} | {r['test_embedded']} | "
                         f"{r['test_diff']:+.4f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--phases", default="images,plain,operators,embedded")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="containers")
    parser.add_argument("--merge", action="store_true",
                        help="keep the saved report's other phases (and the image builds)")
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    work = Path(tempfile.mkdtemp(prefix="ance-containers-"))
    dataset = make_scifact_subset(work / "scifact-subset", max_docs=1000, max_queries=400)
    base = yaml.safe_load(VALUES.read_text())["run"]["config"]
    base["training"]["steps"] = args.steps
    report: dict[str, Any] = {}
    saved = args.out / f"{args.name}.json"
    if args.merge and saved.is_file():  # rerun some phases, keep the others' results
        report = json.loads(saved.read_text())
        report.setdefault("earlier_commands", []).append(
            {"command": report["command"], "date": report["date"]})
    report.update({"command": command_line(), "date": utc_now(), "machine": machine(),
                   "podman": engine("--version").stdout.strip()})
    def save() -> None:  # after every phase: a failure later keeps what was measured
        write_report(args.out, args.name, report, render(report))

    if "images" in phases:
        if not args.skip_build:
            report["images"] = build_images()
        report["breakdown"] = image_breakdown(CPU_IMAGE)
        report["image_checks"] = image_checks(dataset, base)
        save()
    try:
        if "plain" in phases:
            report["plain"] = run_plain(dataset, args.steps)
            save()
        if "operators" in phases:
            every = base["training"]["refresh_every"]
            # Long enough for the scale-up at 2 refreshes and the three kills at 4, 5 and 6.
            report["operators"] = run_operators(dataset, max(args.steps, 8 * every), every)
            save()
    finally:  # a failed phase leaves no pods running; its own error is the one reported
        down = sh(*PLAY, "down", check=False, timeout=900)
        if down.returncode != 0:
            print(f"warning: `down` exited {down.returncode}: {down.stderr[-2000:]}",
                  file=sys.stderr)
    if "embedded" in phases:
        report["embedded"] = run_embedded(dataset, base, "embedded-same-config")
    if "plain" in report and "embedded" in report:
        report["agreement"] = agreement(report["plain"]["evaluations"],
                                        report["embedded"]["evaluations"])
    write_report(args.out, args.name, report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
