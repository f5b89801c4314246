"""services/README.md's table of who reads and writes which event, against the code.

The set of (service, event, reads | writes) is derived from the source with :mod:`ast`,
nothing imported:

* the events are the classes of ``src/ance_train/protocol/events.py`` with a ``TYPE``;
* a service's code is every module of ``src/ance_train/<role>/`` and every first-party module
  they import, directly or not (``scripts/dev/checkpoint_path_modules.py``'s resolver), so the
  shared ``infra/retention.py`` counts for the trainer and the indexer, which run it; the
  test fails if that closure reaches another service's package or the launcher, where this
  attribution would be wrong;
* a service *writes* an event where its code calls ``<x>.publish(<Event>(…))`` and *reads* it
  where it calls ``consume``, ``read_all``, ``history``, ``last_entry_id`` or ``ensure_group``
  (the :class:`~ance_train.infra.bus.EventBus` API, ``src/ance_train/infra/bus.py``) with an
  event class. An argument that is a variable is followed to the enclosing function's
  parameter and its call sites in the module (``RunRetention._read(NegativesReady)``) or to
  its assignment; one that cannot be resolved fails the test, naming the line, so no call is
  silently left out. ``infra/bus.py`` itself, the API, is not a service's use of it.

The table's ``reads`` / ``writes`` cells are parsed for backticked event names
(``negatives.ready``); other entries (object keys, work items, tables, config fields) are
prose, but a backticked name that starts like an event (``negatives.redy``) and is none
fails. Both sets must be equal: a row missing, an event missing or one too many fails.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
EVENTS = SRC / "ance_train" / "protocol" / "events.py"
README = REPO / "services" / "README.md"
SERVICES = ("trainer", "inferencer", "indexer")
BUS_API = "ance_train.infra.bus"
WRITE_METHODS = {"publish"}
READ_METHODS = {"consume", "read_all", "history", "last_entry_id", "ensure_group"}


def _resolver():
    path = REPO / "scripts" / "dev" / "checkpoint_path_modules.py"
    spec = importlib.util.spec_from_file_location("checkpoint_path_modules", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


imports = _resolver()


def event_types() -> dict[str, str]:
    """Class name → event type (``TYPE``) of every event of protocol/events.py."""
    out = {}
    for node in ast.parse(EVENTS.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and statement.target.id == "TYPE"
                    and isinstance(statement.value, ast.Constant)):
                out[node.name] = statement.value.value
    return out


def service_modules(role: str) -> list[str]:
    package = SRC / "ance_train" / role
    own = [f"ance_train.{role}.{path.stem}" for path in sorted(package.glob("*.py"))
           if path.stem != "__init__"]
    return imports.closure(own)


class ModuleEvents:
    """The events one module reads and writes through the bus, found by ast."""

    def __init__(self, path: Path, types: dict[str, str], label: str | None = None) -> None:
        self.label = label or str(path.relative_to(REPO))
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.types = types
        self.names = self._event_names()
        self.parents = {child: parent for parent in ast.walk(self.tree)
                        for child in ast.iter_child_nodes(parent)}

    def _event_names(self) -> dict[str, str]:
        """Local name → event type: ``from ance_train.protocol.events import X [as Y]``;
        ``events.X`` where the module itself is imported is handled in :meth:`_class`."""
        names = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ance_train.protocol.events":
                for alias in node.names:
                    if alias.name in self.types:
                        names[alias.asname or alias.name] = self.types[alias.name]
        return names

    def _class(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr in self.types:
            return self.types[node.attr]
        return None

    def _function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def _where(self, node: ast.AST) -> str:
        return f"{self.label}:{node.lineno}"

    def resolve(self, node: ast.expr, instance: bool, depth: int = 0) -> set[str]:
        """The event types ``node`` may be: a class (``instance`` False) or an instance
        built by calling one (``instance`` True)."""
        if depth > 3:
            raise AssertionError(f"{self._where(node)}: event argument nested too deep")
        if instance and isinstance(node, ast.Call) and self._class(node.func):
            return {self._class(node.func)}
        if not instance and self._class(node):
            return {self._class(node)}
        if isinstance(node, ast.Name):
            function = self._function(node)
            if function is not None:
                params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
                if node.id in params:
                    return self._from_call_sites(function, params.index(node.id), instance,
                                                 depth)
                assigned = [s.value for s in ast.walk(function) if isinstance(s, ast.Assign)
                            and any(isinstance(t, ast.Name) and t.id == node.id
                                    for t in s.targets)]
                if assigned:
                    return set().union(*(self.resolve(v, instance, depth + 1)
                                         for v in assigned))
        raise AssertionError(f"{self._where(node)}: cannot tell which event "
                             f"{ast.unparse(node)!r} is; extend tests/test_event_table.py")

    def _from_call_sites(self, function: ast.FunctionDef | ast.AsyncFunctionDef, index: int,
                         instance: bool, depth: int) -> set[str]:
        is_method = bool(function.args.args) and function.args.args[0].arg in ("self", "cls")
        position = index - 1 if is_method else index
        found: set[str] = set()
        sites = 0
        for call in ast.walk(self.tree):
            if not isinstance(call, ast.Call):
                continue
            callee = call.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(
                callee, "id", None)
            if name != function.name or len(call.args) <= position:
                continue
            sites += 1
            found |= self.resolve(call.args[position], instance, depth + 1)
        if not sites:
            raise AssertionError(f"{self._where(function)}: {function.name} takes the event "
                                 "as an argument but is never called in its module")
        return found

    def uses(self) -> set[tuple[str, str]]:
        out = set()
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            method = call.func.attr
            if method not in WRITE_METHODS | READ_METHODS:
                continue
            receiver = ast.unparse(call.func.value)
            first = call.args[0] if call.args else None
            writes = method in WRITE_METHODS
            if first is None:
                assert "bus" not in receiver.lower(), f"{self._where(call)}: no event argument"
                continue
            try:
                found = self.resolve(first, instance=writes)
            except AssertionError:
                if "bus" in receiver.lower():  # a bus call we cannot read is an error
                    raise
                continue  # some other object's method of the same name
            out |= {(event, "writes" if writes else "reads") for event in found}
        return out


def code_table() -> set[tuple[str, str, str]]:
    types = event_types()
    rows = set()
    for role in SERVICES:
        modules = service_modules(role)
        strays = [m for m in modules if m.startswith("ance_train.launcher") or any(
            m.startswith(f"ance_train.{other}.") for other in SERVICES if other != role)]
        assert not strays, f"{role} imports {strays}: attribute their events explicitly"
        for module in modules:
            if module == BUS_API:
                continue
            uses = ModuleEvents(imports.module_file(module), types).uses()
            rows |= {(role, event, how) for event, how in uses}
    return rows


def readme_table() -> set[tuple[str, str, str]]:
    types = set(event_types().values())
    prefixes = {name.split(".")[0] for name in types}  # checkpoint, shard, negatives, ...
    lines = [line for line in README.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    column = {name: header.index(name) for name in ("service", "reads", "writes")}
    rows = set()
    services = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        service = re.sub(r"\[(\w+)\]\(.*?\)", r"\1", cells[column["service"]])
        services.append(service)
        for how in ("reads", "writes"):
            for name in re.findall(r"`([^`]+)`", cells[column[how]]):
                if name in types:
                    rows.add((service, name, how))
                else:  # a typo of an event must not pass as prose (config fields may)
                    assert name.split(".")[0] not in prefixes, (
                        f"services/README.md: {service} {how} unknown event `{name}`")
    assert sorted(services) == sorted(SERVICES), services
    return rows


def test_the_code_shows_every_service_using_the_bus() -> None:
    """The derivation finds something for each service (a broken parser finds nothing)."""
    derived = code_table()
    for role in SERVICES:
        assert any(row[0] == role and row[2] == "writes" for row in derived), role
    assert ("trainer", "negatives.ready", "reads") in derived
    assert ("indexer", "checkpoint.published", "reads") in derived
    assert ("inferencer", "shard.encoded", "writes") in derived


def test_services_readme_table_matches_the_code() -> None:
    derived, documented = code_table(), readme_table()
    missing = sorted(derived - documented)
    extra = sorted(documented - derived)
    assert not missing and not extra, (
        f"services/README.md's event table differs from the code:\n"
        f"  in the code, not in the table: {missing}\n"
        f"  in the table, not in the code: {extra}")


@pytest.mark.parametrize("source, expected", [
    ("bus.publish(NegativesReady(tables=()))", {("negatives.ready", "writes")}),
    ("for r in ctx.bus.history(ShardFailed): pass", {("shard.failed", "reads")}),
    ("class R:\n"
     "    def _read(self, event_type):\n"
     "        return self.bus.read_all(event_type)\n"
     "    def go(self):\n"
     "        self._read(RunFinished)\n", {("run.finished", "reads")}),
])
def test_the_derivation_reads_direct_and_indirect_calls(
        tmp_path: Path, source: str, expected: set[tuple[str, str]]) -> None:
    module = tmp_path / "probe.py"
    module.write_text("from ance_train.protocol.events import NegativesReady, RunFinished, "
                      "ShardFailed\n" + source)
    assert ModuleEvents(module, event_types(), "probe.py").uses() == expected


def test_an_unresolvable_bus_call_fails(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("def f(bus, thing):\n    bus.publish(thing)\n")
    with pytest.raises(AssertionError, match="never called"):
        ModuleEvents(module, event_types(), "probe.py").uses()
