"""Play the chart's rendered pod specs as real containers with ``podman kube play``.

There is no Kubernetes API server here, so nothing runs the controllers or a kubelet. This
script does, for the objects ``helm template`` renders, the few things they would do and
podman 4.3's ``kube play`` cannot; everything else (images, commands, init containers,
security contexts, read-only root file systems, ConfigMap and claim volumes, restart
policies, memory limits) is podman playing the manifest as written:

- **Controllers.** A Job or a StatefulSet is played as its pod template (podman 4.3 ignores a
  Job, and has no StatefulSet); each Deployment replica is one Pod named ``<deployment>-<i>``,
  so that a replica can be added or killed on its own, as the ReplicaSet controller would.
  A StatefulSet's ``volumeClaimTemplates`` become PersistentVolumeClaims (podman volumes).
- **The kubelet's environment.** ``valueFrom`` (``fieldRef`` ``metadata.name`` /
  ``metadata.namespace`` / ``status.podIP``, ``secretKeyRef``, ``configMapKeyRef``) is
  resolved to a value and ``$(VAR)`` expanded: podman 4.3 refuses the ``status.podIP`` and
  ``metadata.namespace`` field paths, and cannot read back a Secret it created from a manifest
  ("secret ... is not valid JSON").
- **Annotations.** podman 4.3 refuses an annotation value over 63 characters ("value length
  exceeds Kubernetetes max 63", a limit Kubernetes puts on label values only), such as the
  chart's ``checksum/config``: those are left out (they only roll pods on a config change).
- **emptyDir.** podman 4.3 makes an emptyDir a volume named after the volume alone, so
  every pod's ``work`` was one volume, shared by all the release's pods and kept from run to
  run (a trainer found an inferencer's downloads in its own checkpoint folder). Each emptyDir
  becomes ``<pod>-<volume>``, removed before the pod is played: a new pod starts empty.
- **Ports.** podman 4.3 publishes every ``containerPort`` on the host (it bound the host's
  :9100 for the first inferencer, and a second one could not start), where Kubernetes only
  declares it: ``ports`` are left out (a probe's named port becomes its number first). Pods
  reach each other on the pod network, where every port is open, as in a cluster.
- **Cluster DNS.** Each pod gets a fixed address on a podman network this script creates,
  and every pod gets ``hostAliases`` for each Service name (and a few extra names, such as an
  external store's host) pointing at the address of the pod the Service selects.

Commands (state in ``build/containers/<release>/``)::

    python scripts/containers/play_chart.py up --values helm/examples/values-local.yaml \
        --dataset DIR
    python scripts/containers/play_chart.py pods            # as `kubectl get pods`
    python scripts/containers/play_chart.py logs POD        # as `kubectl logs POD`
    python scripts/containers/play_chart.py scale inferencer 3
    python scripts/containers/play_chart.py kill POD        # the pod dies; its controller
                                                            # replaces it
    python scripts/containers/play_chart.py test            # as `helm test`
    python scripts/containers/play_chart.py down

Traffic stays on loopback and on the addresses of the network the script creates
(``--subnet``, default 10.213.0.0/24).
"""

from __future__ import annotations

import argparse
import base64
import copy
import ipaddress
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "ance-train"
ENGINE = REPO / "scripts" / "containers" / "engine.sh"
S3_IMAGE_DEFAULT = "localhost/ance-train-s3:0.1.0"
# Kinds this script plays; others (RBAC, Services, the AnceRun, policies) have no effect on an
# engine without an API server and are listed by `up` as skipped.
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def engine(*args: str, check: bool = True, capture: bool = True,
           timeout: float | None = 600) -> subprocess.CompletedProcess[str]:
    """Run podman with the flags of scripts/containers/engine.sh."""
    command = f'. "{ENGINE}"; engine "$@"'
    done = subprocess.run(["bash", "-c", command, "engine", *args], check=False, text=True,
                          capture_output=capture, timeout=timeout)
    if check and done.returncode != 0:
        raise SystemExit(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done


# --------------------------------------------------------------------------- rendering


def render(values_files: list[Path], overrides: dict[str, Any], release: str,
           namespace: str) -> tuple[list[dict[str, Any]], str]:
    """The chart's objects and NOTES.txt, as ``helm template`` renders them (real Helm)."""
    import helm_python as helm

    values: dict[str, Any] = {}
    for path in values_files:
        values = merge(values, yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    values = merge(values, overrides)
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    objects, notes = [], ""
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            notes = manifests[path]
        else:
            objects.extend(doc for doc in yaml.safe_load_all(manifests[path]) if doc)
    return objects, notes


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``helm -f a -f b`` merging: mappings key by key, anything else replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set a.b=c`` (the value read as YAML) into nested values."""
    out: dict[str, Any] = {}
    for item in items:
        path, _, raw = item.partition("=")
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


# --------------------------------------------------------------------------- the cluster


@dataclass
class Workload:
    kind: str
    name: str
    replicas: int
    template: dict[str, Any]
    claim_templates: list[dict[str, Any]] = field(default_factory=list)

    def pod_name(self, index: int) -> str:
        return f"{self.name}-{index}"


@dataclass
class LocalCluster:
    """The rendered release, and what a controller + kubelet need to play it."""

    release: str
    namespace: str
    objects: list[dict[str, Any]]
    subnet: ipaddress.IPv4Network
    extra_hosts: dict[str, str] = field(default_factory=dict)  # name -> pod name

    @property
    def state_dir(self) -> Path:
        return REPO / "build" / "containers" / self.release

    @property
    def network(self) -> str:
        return f"{self.release}-net"

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def workloads(self) -> list[Workload]:
        found = []
        for obj in self.objects:
            if obj["kind"] not in WORKLOAD_KINDS:
                continue
            spec = obj["spec"]
            replicas = 1 if obj["kind"] == "Job" else int(spec.get("replicas", 1))
            found.append(Workload(obj["kind"], obj["metadata"]["name"], replicas,
                                  spec["template"], spec.get("volumeClaimTemplates", [])))
        return found

    def workload(self, name: str) -> Workload:
        for w in self.workloads():
            if w.name in (name, f"{self.release}-{name}"):
                return w
        raise SystemExit(f"no workload {name!r}: {[w.name for w in self.workloads()]}")

    def secret_values(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for secret in self.of_kind("Secret"):
            values = {k: base64.b64decode(v).decode() for k, v in
                      (secret.get("data") or {}).items()}
            values.update(secret.get("stringData") or {})
            out[secret["metadata"]["name"]] = values
        return out

    def config_maps(self) -> dict[str, dict[str, Any]]:
        return {c["metadata"]["name"]: c for c in self.of_kind("ConfigMap")}

    def test_pods(self) -> list[dict[str, Any]]:
        """The chart's `helm test` hooks (Pods annotated helm.sh/hook: test)."""
        return [o for o in self.of_kind("Pod")
                if "test" in o["metadata"].get("annotations", {}).get("helm.sh/hook", "")]

    # Addresses: .2-.9 the test hooks, .10-.15 the extras, then a block of 16 for each
    # workload (in rendering order).
    def address(self, pod: str) -> str:
        hosts = list(self.subnet.hosts())
        names = ["__extra__"] + [w.name for w in self.workloads()]
        tests = [t["metadata"]["name"] for t in self.test_pods()]
        if pod in tests:
            return str(hosts[1 + tests.index(pod)])
        if pod in self.extra_pods():
            return str(hosts[9 + self.extra_pods().index(pod)])
        for block, name in enumerate(names):
            if pod.startswith(f"{name}-") and pod[len(name) + 1:].isdigit():
                index = int(pod[len(name) + 1:]) % 16
                return str(hosts[16 * (block + 1) + index])
        raise SystemExit(f"no address for pod {pod!r}")

    def extra_pods(self) -> list[str]:
        return sorted(set(self.extra_hosts.values()))

    def host_aliases(self) -> list[dict[str, Any]]:
        """Service names (short and cluster-qualified) -> the first pod each selects."""
        aliases: dict[str, list[str]] = {}
        for service in self.of_kind("Service"):
            selector = service["spec"].get("selector") or {}
            for w in self.workloads():
                labels = w.template["metadata"].get("labels", {})
                if selector and all(labels.get(k) == v for k, v in selector.items()):
                    name = service["metadata"]["name"]
                    ip = self.address(w.pod_name(0))
                    aliases.setdefault(ip, []).extend(
                        [name, f"{name}.{self.namespace}", f"{name}.{self.namespace}.svc",
                         f"{name}.{self.namespace}.svc.cluster.local"])
                    if w.kind == "StatefulSet":  # stable pod names behind the headless service
                        for i in range(w.replicas):
                            aliases.setdefault(self.address(w.pod_name(i)), []).append(
                                f"{w.pod_name(i)}.{name}")
                    break
        for host, pod in self.extra_hosts.items():
            aliases.setdefault(self.address(pod), []).append(host)
        return [{"ip": ip, "hostnames": sorted(set(names))} for ip, names in aliases.items()]

    # ------------------------------------------------------------------ pods

    def pod_manifests(self, workload: Workload, pod_name: str) -> list[dict[str, Any]]:
        """The Pod (and the ConfigMaps and claims it uses) for one replica of ``workload``."""
        template = copy.deepcopy(workload.template)
        spec = template["spec"]
        ip = self.address(pod_name)
        secrets, config_maps = self.secret_values(), self.config_maps()
        for container in spec.get("initContainers", []) + spec["containers"]:
            resolve_environment(container, pod_name, self.namespace, ip, secrets, config_maps)
            unpublish_ports(container)
        own_empty_dirs(spec, pod_name)
        spec["hostAliases"] = self.host_aliases() + spec.get("hostAliases", [])
        docs: list[dict[str, Any]] = []
        if workload.kind == "Job" and spec.get("restartPolicy") not in ("Never", "OnFailure"):
            spec["restartPolicy"] = "Never"
        ordinal = pod_name.rsplit("-", 1)[1]
        for claim in workload.claim_templates:
            claim_name = f"{claim['metadata']['name']}-{workload.name}-{ordinal}"
            docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": claim_name}, "spec": claim["spec"]})
            spec.setdefault("volumes", []).append(
                {"name": claim["metadata"]["name"],
                 "persistentVolumeClaim": {"claimName": claim_name}})
        used_maps = {v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
        docs.extend(config_maps[name] for name in sorted(used_maps))
        docs.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": pod_name,
                                  "labels": template["metadata"].get("labels", {}),
                                  "annotations": {
                                      k: v for k, v in
                                      template["metadata"].get("annotations", {}).items()
                                      if len(str(v)) <= 63}},
                     "spec": spec})
        return docs

    def play(self, workload: Workload, pod_name: str) -> float:
        """Play one pod; returns the seconds podman took."""
        # A claim outlives its pod: a replacement pod binds the volume already made.
        docs = [d for d in self.pod_manifests(workload, pod_name)
                if d["kind"] != "PersistentVolumeClaim" or engine(
                    "volume", "exists", d["metadata"]["name"], check=False).returncode != 0]
        start = time.monotonic()
        self.kube_play(pod_name, docs)
        return time.monotonic() - start

    def play_extra(self, pod_name: str, docs: list[dict[str, Any]]) -> None:
        """A pod that is not the chart's (the external store)."""
        for doc in docs:
            if doc["kind"] == "Pod":
                doc["spec"]["hostAliases"] = self.host_aliases()
        self.kube_play(pod_name, docs)

    def kube_play(self, pod_name: str, docs: list[dict[str, Any]]) -> None:
        """Write the pod's manifests under build/ and play them at the pod's address, its
        emptyDir volumes removed first (left by an earlier pod of that name)."""
        for name in empty_dir_volumes(docs):
            engine("volume", "rm", "--force", name, check=False)
        path = self.state_dir / "pods" / f"{pod_name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
        engine("kube", "play", "--network", self.network, "--ip", self.address(pod_name),
               str(path))

    def remove(self, pod_name: str) -> None:
        engine("pod", "rm", "--force", "--time", "0", pod_name, check=False)

    def ensure_network(self) -> None:
        if engine("network", "exists", self.network, check=False).returncode != 0:
            engine("network", "create", "--subnet", str(self.subnet), self.network)


def own_empty_dirs(spec: dict[str, Any], pod_name: str) -> None:
    """Name each emptyDir volume (and its mounts) ``<pod>-<volume>`` (the module's
    docstring)."""
    renamed = {v["name"]: f"{pod_name}-{v['name']}" for v in spec.get("volumes", [])
               if "emptyDir" in v}
    for volume in spec.get("volumes", []):
        volume["name"] = renamed.get(volume["name"], volume["name"])
    for container in spec.get("initContainers", []) + spec["containers"]:
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])


def empty_dir_volumes(docs: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for d in docs if d["kind"] == "Pod"
            for v in d["spec"].get("volumes", []) if "emptyDir" in v]


def unpublish_ports(container: dict[str, Any]) -> None:
    """Drop ``ports`` (see the module's docstring), naming probe ports by number first."""
    numbers = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        for action in ("tcpSocket", "httpGet", "grpc"):
            target = container.get(probe, {}).get(action)
            if target and isinstance(target.get("port"), str):
                target["port"] = numbers[target["port"]]
    container.pop("ports", None)


def resolve_environment(container: dict[str, Any], pod_name: str, namespace: str, ip: str,
                        secrets: dict[str, dict[str, str]],
                        config_maps: dict[str, dict[str, Any]]) -> None:
    """What a kubelet does to a container's env, command and args before starting it."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
              "status.podIP": ip, "spec.nodeName": "localhost"}
    resolved: dict[str, str] = {}
    env = []
    for item in container.get("env", []):
        source = item.get("valueFrom")
        if source is None:
            value = VAR_REF.sub(lambda m: resolved.get(m.group(1), m.group(0)),
                                str(item.get("value", "")))
        elif "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = secrets[ref["name"]][ref["key"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = config_maps[ref["name"]]["data"][ref["key"]]
        else:
            raise SystemExit(f"{pod_name}: env {item['name']}: unsupported {sorted(source)}")
        resolved[item["name"]] = value
        env.append({"name": item["name"], "value": value})
    if env:
        container["env"] = env
    for key in ("command", "args"):
        if key in container:
            container[key] = [VAR_REF.sub(lambda m: resolved.get(m.group(1), m.group(0)), str(a))
                              for a in container[key]]


# --------------------------------------------------------------------------- the store


def s3_pod(name: str, image: str) -> list[dict[str, Any]]:
    """moto's S3 server in a pod of its own: the store outside the release."""
    return [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
             "spec": {"restartPolicy": "Always",
                      "containers": [{"name": "s3", "image": image,
                                      "imagePullPolicy": "Never"}]}}]


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.5) -> float:
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except Exception:
            pass
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"{what}: not ready after {timeout_s:g}s")
        time.sleep(interval_s)


def upload_folder(endpoint: str, access: str, secret: str, url: str, source: Path) -> int:
    """Copy a local folder (a BEIR dataset, a model) to ``url`` (s3://bucket/prefix/), as an
    operator's ``aws s3 cp --recursive`` / ``mc cp`` would; returns the number of files."""
    from minio import Minio

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = Minio(endpoint, access_key=access, secret_key=secret, secure=False)
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    count = 0
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        client.fput_object(bucket, prefix.rstrip("/") + "/" + path.relative_to(source).as_posix(),
                           str(path))
        count += 1
    return count


# --------------------------------------------------------------------------- commands


def load_cluster(args: argparse.Namespace) -> LocalCluster:
    state = REPO / "build" / "containers" / args.release / "state.json"
    if args.command != "up" and state.is_file():
        saved = json.loads(state.read_text())
        values_files = [Path(p) for p in saved["values"]]
        overrides = saved["overrides"]
        subnet = saved["subnet"]
    else:
        values_files = [Path(p).resolve() for p in args.values]
        overrides = parse_set(args.set)
        subnet = args.subnet
    objects, notes = render(values_files, overrides, args.release, args.namespace)
    cluster = LocalCluster(args.release, args.namespace, objects,
                           ipaddress.ip_network(subnet))
    cluster.notes = notes  # type: ignore[attr-defined]
    endpoint = s3_endpoint(cluster)
    if endpoint:
        cluster.extra_hosts[endpoint.split(":")[0]] = f"{args.release}-external-s3-0"
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"values": [str(p) for p in values_files],
                                 "overrides": overrides, "subnet": subnet}, indent=1))
    return cluster


def s3_endpoint(cluster: LocalCluster) -> str:
    """The external store's endpoint the chart's pods use (externalS3 with minio off)."""
    for w in cluster.workloads():
        for c in w.template["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"] == "ANCE_S3_ENDPOINT" and "minio" not in e.get("value", ""):
                    return e["value"]
    return ""


def ance_env(cluster: LocalCluster) -> dict[str, str]:
    """The ANCE_* settings of the trainer's container, resolved (for host-side reads)."""
    trainer = next(w for w in cluster.workloads() if w.kind == "Job")
    pod = trainer.pod_name(0)
    container = copy.deepcopy(trainer.template["spec"]["containers"][0])
    resolve_environment(container, pod, cluster.namespace, cluster.address(pod),
                        cluster.secret_values(), cluster.config_maps())
    return {e["name"]: e["value"] for e in container["env"]}


def command_up(cluster: LocalCluster, args: argparse.Namespace) -> None:
    cluster.ensure_network()
    timings: dict[str, float] = {}
    env = ance_env(cluster)
    skipped = sorted({f"{o['kind']}/{o['metadata']['name']}" for o in cluster.objects
                      if o["kind"] not in (*WORKLOAD_KINDS, "ConfigMap", "Secret")})
    print(f"no effect without an API server (not played): {', '.join(skipped)}")
    endpoint = s3_endpoint(cluster)
    if endpoint:
        host, _, port = endpoint.partition(":")
        pod = cluster.extra_hosts[host]
        address = f"{cluster.address(pod)}:{port or 80}"
        if not args.skip_store:
            cluster.play_extra(pod, s3_pod(pod, args.s3_image))
            timings["s3 ready"] = wait_for("the S3 pod", lambda: _http_ok(address), 60)
        (cluster.state_dir / "store.json").write_text(json.dumps(
            {"address": address, "access_key": env["ANCE_S3_ACCESS_KEY"],
             "secret_key": env["ANCE_S3_SECRET_KEY"]}))
        if args.dataset:
            config = yaml.safe_load(cluster.config_maps()[f"{cluster.release}-config"]["data"]
                                    ["config.yaml"])
            count = upload_folder(address, env["ANCE_S3_ACCESS_KEY"], env["ANCE_S3_SECRET_KEY"],
                                   config["data"]["path"], Path(args.dataset))
            print(f"dataset: {count} files from {args.dataset} to {config['data']['path']}")
    if args.only_store:
        return
    order = sorted(cluster.workloads(), key=lambda w: ("redis" not in w.name, w.kind == "Job"))
    for workload in order:
        for i in range(workload.replicas):
            pod = workload.pod_name(i)
            timings[f"play {pod}"] = cluster.play(workload, pod)
            print(f"played {workload.kind}/{workload.name} as pod {pod} "
                  f"({cluster.address(pod)})")
        if "redis" in workload.name:
            address = cluster.address(workload.pod_name(0))
            timings["redis ready"] = wait_for(
                "redis", lambda a=address: _redis_ok(a, env["ANCE_REDIS_PASSWORD"]), 60)
    (cluster.state_dir / "up.json").write_text(json.dumps(timings, indent=1))
    print(json.dumps(timings, indent=1))


def _http_ok(address: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/", timeout=2) as response:
        return response.status < 500


def _redis_ok(host: str, password: str) -> bool:
    import redis

    return bool(redis.Redis(host=host, port=6379, password=password,
                            socket_timeout=2).ping())


def pods(cluster: LocalCluster) -> list[dict[str, str]]:
    out = engine("pod", "ps", "--format", "json").stdout
    rows = []
    for pod in json.loads(out or "[]"):
        if pod["Name"].startswith(cluster.release):
            rows.append({"name": pod["Name"], "status": pod["Status"],
                         "containers": ",".join(f"{c['Names']}:{c['Status']}"
                                                for c in pod.get("Containers", []))})
    return rows


def main_container(pod: str) -> str:
    names = engine("ps", "-a", "--pod", "--filter", f"pod={pod}", "--format",
                   "{{.Names}}").stdout.split()
    real = [n for n in names if not n.endswith("-infra")]
    return real[-1] if real else pod


def command_scale(cluster: LocalCluster, args: argparse.Namespace) -> None:
    workload = cluster.workload(args.workload)
    existing = {r["name"] for r in pods(cluster)}
    for i in range(args.replicas):
        pod = workload.pod_name(i)
        if pod not in existing:
            cluster.play(workload, pod)
            print(f"played {pod}")
    for pod in sorted(existing):
        if pod.startswith(f"{workload.name}-"):
            suffix = pod[len(workload.name) + 1:]
            if suffix.isdigit() and int(suffix) >= args.replicas:
                cluster.remove(pod)
                print(f"removed {pod}")


def command_kill(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """The pod dies (SIGKILL to every container), then its controller replaces it with a
    pod of the same spec: a new pod, with empty emptyDir volumes."""
    pod = args.pod
    name, _, index = pod.rpartition("-")
    workload = cluster.workload(name)
    engine("pod", "kill", "--signal", "KILL", pod, check=False)
    cluster.remove(pod)
    cluster.play(workload, workload.pod_name(int(index)))
    print(f"killed and replaced {pod}")


def command_test(cluster: LocalCluster, timeout_s: float = 900) -> int:
    """`helm test`: play each test hook's Pod, wait for it to exit, print its log; the exit
    status is the hooks' (0 when all passed)."""
    worst = 0
    for hook in cluster.test_pods():
        name = hook["metadata"]["name"]
        pod = copy.deepcopy(hook)
        for container in pod["spec"]["containers"]:
            resolve_environment(container, name, cluster.namespace, cluster.address(name),
                                cluster.secret_values(), cluster.config_maps())
            unpublish_ports(container)
        own_empty_dirs(pod["spec"], name)
        pod["spec"]["hostAliases"] = cluster.host_aliases()
        pod["metadata"]["annotations"] = {}  # hook annotations mean nothing to podman
        cluster.remove(name)
        start = time.monotonic()
        cluster.kube_play(name, [pod])
        container = f"{name}-{pod['spec']['containers'][0]['name']}"
        while True:
            state = engine("inspect", container, "--format",
                           "{{.State.Status}} {{.State.ExitCode}}").stdout.split()
            if state[0] == "exited":
                break
            if time.monotonic() - start > timeout_s:
                raise SystemExit(f"{name}: still running after {timeout_s:g}s")
            time.sleep(1)
        log = engine("logs", container)
        print(f"TEST SUITE: {name}\nPhase: {'Succeeded' if state[1] == '0' else 'Failed'} "
              f"({time.monotonic() - start:.1f}s)\n{log.stdout}{log.stderr}")
        worst = max(worst, int(state[1]))
        cluster.remove(name)
    return worst


def command_down(cluster: LocalCluster) -> None:
    for row in pods(cluster):
        cluster.remove(row["name"])
    for volume in engine("volume", "ls", "--format", "{{.Name}}").stdout.split():
        if cluster.release in volume:
            engine("volume", "rm", "--force", volume, check=False)
    engine("network", "rm", "--force", cluster.network, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--release", default="ance-train")
    parser.add_argument("--namespace", default="default")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="render the chart and play every workload")
    up.add_argument("--values", action="append", default=[], help="values file (repeatable)")
    up.add_argument("--set", action="append", default=[], help="key.path=value (repeatable)")
    up.add_argument("--subnet", default="10.213.0.0/24")
    up.add_argument("--dataset", help="a local BEIR folder to copy to run.config.data.path")
    up.add_argument("--s3-image", default=S3_IMAGE_DEFAULT)
    up.add_argument("--only-store", action="store_true",
                    help="play the external store (and copy the dataset) only")
    up.add_argument("--skip-store", action="store_true",
                    help="the external store is already up: play the release's pods only")
    sub.add_parser("pods", help="the release's pods, as `kubectl get pods`")
    logs = sub.add_parser("logs", help="a pod's log, as `kubectl logs`")
    logs.add_argument("pod")
    scale = sub.add_parser("scale", help="set a Deployment's replica count")
    scale.add_argument("workload")
    scale.add_argument("replicas", type=int)
    kill = sub.add_parser("kill", help="kill a pod; its controller replaces it")
    kill.add_argument("pod")
    sub.add_parser("notes", help="print NOTES.txt")
    sub.add_parser("test", help="run the chart's test hooks, as `helm test`")
    sub.add_parser("down", help="remove every pod, volume and the network")
    args = parser.parse_args(argv)
    if args.command != "up":
        args.values, args.set, args.subnet = [], [], "10.213.0.0/24"
    cluster = load_cluster(args)
    if args.command == "up":
        command_up(cluster, args)
    elif args.command == "pods":
        for row in pods(cluster):
            print(f"{row['name']:40} {row['status']:10} {row['containers']}")
    elif args.command == "logs":
        log = engine("logs", main_container(args.pod))  # podman keeps stdout and stderr apart
        sys.stdout.write(log.stdout + log.stderr)
    elif args.command == "scale":
        command_scale(cluster, args)
    elif args.command == "kill":
        command_kill(cluster, args)
    elif args.command == "test":
        return command_test(cluster)
    elif args.command == "notes":
        print(cluster.notes)  # type: ignore[attr-defined]
    elif args.command == "down":
        command_down(cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
