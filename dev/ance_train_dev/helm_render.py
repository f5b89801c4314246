"""Render and lint the Helm chart with real Helm, for tests.

Helm's own Go SDK does the work, through the ``helm-python-sdk`` bindings (``helm_python``,
Helm v4): ``Chart.render`` is ``helm template`` (values coalesced with the chart's defaults,
``values.schema.json`` enforced, ``lookup`` answering nothing as no cluster is contacted) and
``lint`` is ``helm lint``. Nothing here interprets a template.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "ance-train"
RELEASE = "ance-train"
NAMESPACE = "ml"
# The Kubernetes version the chart is linted and its objects validated against: the newest
# whose schemas kubernetes-validate ships.
KUBE_VERSION = "1.37"

HelmError = helm.HelmError


def merge_values(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into ``base`` as ``helm -f a.yaml -f b.yaml`` does.

    Mappings merge key by key; any other value (lists included) replaces the earlier one.
    """
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def user_values(values: Mapping[str, Any] | None, values_files: Iterable[Path]) -> dict[str, Any]:
    """The user-supplied values: the files in order, then ``values`` on top (like ``--set``)."""
    merged: dict[str, Any] = {}
    for path in values_files:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        merged = merge_values(merged, loaded)
    return merge_values(merged, values or {})


def render_manifests(
    values: Mapping[str, Any] | None = None,
    values_files: Iterable[Path] = (),
    *,
    chart_dir: Path = CHART_DIR,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Rendered text of every template (``NOTES.txt`` included), keyed by template path.

    Raises ``HelmError`` (``HelmValuesError`` for values the schema rejects,
    ``HelmRenderError`` for a broken template).
    """
    with helm.Chart.load(chart_dir) as chart:
        return chart.render(user_values(values, values_files), name=release,
                            namespace=namespace, is_install=True)


def render_crds(chart_dir: Path = CHART_DIR) -> list[dict[str, Any]]:
    """The chart's ``crds/`` objects, as Helm loads them (installed as-is, never templated)."""
    with helm.Chart.load(chart_dir) as chart:
        return [doc for crd in chart.crds for doc in yaml.safe_load_all(crd["data"]) if doc]


def render_chart(
    values: dict | None = None,
    values_files: Iterable[Path] = (),
    *,
    include_crds: bool = True,
    chart_dir: Path = CHART_DIR,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[dict[str, Any]]:
    """Every object ``helm install`` would create: the CRDs first, then the templates."""
    manifests = render_manifests(values, values_files, chart_dir=chart_dir, release=release,
                                 namespace=namespace)
    objects = render_crds(chart_dir) if include_crds else []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(manifests[path]) if doc)
    return objects


def render_notes(values: dict | None = None, values_files: Iterable[Path] = ()) -> str:
    """The NOTES.txt Helm prints after an install."""
    manifests = render_manifests(values, values_files)
    return next(text for path, text in manifests.items() if path.endswith("templates/NOTES.txt"))


@dataclass(frozen=True)
class LintResult:
    """``helm lint --strict`` findings: errors (and warnings, which strict mode fails on)."""

    errors: list[str]
    messages: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.errors


def lint_chart(
    values: dict | None = None,
    values_files: Iterable[Path] = (),
    *,
    chart_dir: Path = CHART_DIR,
) -> LintResult:
    """Lint the chart as ``helm lint --strict --kube-version`` with the given values."""
    report = helm.lint(chart_dir, user_values(values, values_files) or None, strict=True,
                       namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0")
    warnings = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return LintResult(errors=list(dict.fromkeys([*report["errors"], *warnings])),
                      messages=report["messages"])


def find(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> list[dict]:
    """Objects of ``kind`` (and ``metadata.name`` if given)."""
    return [o for o in objects
            if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The single object of ``kind`` named ``name``; fails loudly otherwise."""
    found = find(objects, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name!r}, found {len(found)}")
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment / StatefulSet / Job."""
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """Init and regular containers of a workload."""
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]
