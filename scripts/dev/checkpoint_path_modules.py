"""How many first-party modules a checkpoint's journey touches, computed from the code.

docs/architecture.md ("The life of a checkpoint") cites this script's output. It parses the
source with :mod:`ast` and imports nothing, so it runs without the package's dependencies.

The journey starts at the modules that handle a checkpoint or what is made from it, in the
order it travels (``ENTRY_MODULES``):

1. ``trainer.checkpoints``: saves the checkpoint, uploads it, queues its shards, publishes
   ``checkpoint.published``. ``trainer.trainer`` (the loop that decides *when*) is not an
   entry: its imports are the whole training loop (GradCache, data parallelism, tracking),
   which no checkpoint passes through;
2. ``inferencer.inferencer``: claims a shard, loads the checkpoint, encodes;
   ``inferencer.uploader``: stores the shard, publishes ``shard.encoded``;
3. ``indexer.indexer``: collects the shards, builds the index, mines, evaluates, publishes
   ``negatives.ready`` and ``eval.completed``;
4. ``trainer.negatives_feed``: receives ``negatives.ready``, loads the table;
   ``trainer.negative_sources`` and ``trainer.batches``: the next batch's negatives drawn from it.

Two counts, entry modules included: **direct**, the entry modules and the first-party modules
(``ance_train.*``) they import themselves, the code the journey's own steps call into; and
**transitive**, the closure of those imports, every first-party module loaded for the journey
(``runtime`` alone brings the gRPC server, the AnceRun reporter, dataset validation). Rules:

* every ``import`` / ``from … import`` statement counts, at module level or inside a function
  (a lazy import runs when the journey calls that function), except those under
  ``if TYPE_CHECKING:``, which never run; ``--top-level-only`` counts module-level ones only;
* ``from ance_train.a import b`` is the module ``ance_train.a.b`` when that file exists, else
  the module ``ance_train.a`` (a name defined in it);
* a package's ``__init__.py`` counts only when it is itself the target of an import (e.g.
  ``ance_train.infra.store``, which defines ``store_from_env``): the parents Python executes
  on the way are docstrings, except ``ance_train/__init__.py``, whose one lazy import
  (``Run``) no service triggers;
* the generated gRPC code (``ance_train.infra.proto``) is listed but not counted
  (``--count-generated`` counts it);
* ``ance_train.config`` loads every strategy module, through the entry points of
  pyproject.toml's group ``ance_train.negative_strategies`` (``registered_strategies``, at the
  first validation): they count as lazy imports of ``config``. A run uses one of them:
  ``strategies (one per run)`` is the count with the strategy modules (``negatives/strategies/``
  less ``base`` and ``registry``) counted as one.

Run from the repository root::

    python scripts/dev/checkpoint_path_modules.py            # the list and the counts
    python scripts/dev/checkpoint_path_modules.py --json     # the same, machine-readable
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = "ance_train"

ENTRY_MODULES = (
    "ance_train.trainer.checkpoints",
    "ance_train.inferencer.inferencer",
    "ance_train.inferencer.uploader",
    "ance_train.indexer.indexer",
    "ance_train.trainer.negatives_feed",
    "ance_train.trainer.negative_sources",
    "ance_train.trainer.batches",
)
GENERATED = "ance_train.infra.proto"
STRATEGIES = "ance_train.negatives.strategies"
STRATEGY_SUPPORT = ("ance_train.negatives.strategies.base",
                    "ance_train.negatives.strategies.registry")
# The module that loads the strategies' entry points (no import statement names them).
ENTRY_POINT_LOADER = ("ance_train.config", "ance_train.negative_strategies")


def entry_point_modules(group: str, src: Path = SRC) -> set[str]:
    """The modules of the entry points of ``group`` in the pyproject.toml above ``src``."""
    pyproject = src.parent / "pyproject.toml"
    if not pyproject.is_file():
        return set()
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    entries = project.get("entry-points", {}).get(group, {})
    return {value.partition(":")[0].strip() for value in entries.values()}


def module_file(module: str, src: Path = SRC) -> Path | None:
    """The file of a first-party module (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = src.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module, top_level_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run: not under ``if TYPE_CHECKING:``; with
    ``top_level_only``, not inside a function or class either."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif top_level_only and isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            return
        else:
            visit(node)

    visit(tree)
    return found


def first_party_imports(module: str, src: Path = SRC, top_level_only: bool = False
                        ) -> set[str]:
    """The first-party modules ``module`` imports (resolved as the module docstring says)."""
    path = module_file(module, src)
    if path is None:
        raise FileNotFoundError(f"no module {module} under {src}")
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in _import_nodes(tree, top_level_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if module_file(sub, src) else base)
        for target in targets:
            if target == PACKAGE or not target.startswith(PACKAGE + "."):
                continue
            while module_file(target, src) is None and "." in target:
                target = target.rsplit(".", 1)[0]  # ``import a.b.name`` forms
            if module_file(target, src) is not None:
                out.add(target)
    if module == ENTRY_POINT_LOADER[0] and not top_level_only:  # loaded in a function
        out |= {target for target in entry_point_modules(ENTRY_POINT_LOADER[1], src)
                if module_file(target, src) is not None}
    out.discard(module)
    return out


def direct(entries: tuple[str, ...] | list[str], src: Path = SRC,
           top_level_only: bool = False) -> list[str]:
    """``entries`` and the first-party modules they import themselves."""
    seen = dict.fromkeys(entries)
    for module in entries:
        seen.update(dict.fromkeys(sorted(first_party_imports(module, src, top_level_only))))
    return list(seen)


def closure(entries: tuple[str, ...] | list[str], src: Path = SRC,
            top_level_only: bool = False) -> list[str]:
    """``entries`` and every first-party module they import, directly or not, in the order
    they are first reached (breadth first from the entries, in their order)."""
    seen: dict[str, None] = {}
    queue = list(entries)
    while queue:
        module = queue.pop(0)
        if module in seen:
            continue
        seen[module] = None
        queue += sorted(first_party_imports(module, src, top_level_only) - set(seen))
    return list(seen)


def counts(modules: list[str], count_generated: bool = False) -> dict[str, int]:
    counted = [m for m in modules if count_generated or not m.startswith(GENERATED)]
    strategies = [m for m in counted if m.startswith(STRATEGIES + ".")
                  and m not in STRATEGY_SUPPORT]
    return {
        "modules": len(counted),
        "strategies (one per run)": len(counted) - len(strategies) + min(1, len(strategies)),
        "strategy modules": len(strategies),
        "generated, not counted": 0 if count_generated else len(modules) - len(counted),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-level-only", action="store_true",
                        help="count module-level imports only (no lazy imports in functions)")
    parser.add_argument("--count-generated", action="store_true",
                        help="count the generated gRPC modules too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    near = direct(ENTRY_MODULES, top_level_only=args.top_level_only)
    modules = closure(ENTRY_MODULES, top_level_only=args.top_level_only)
    result = {"entries": ENTRY_MODULES,
              "direct": {**counts(near, args.count_generated), "list": near},
              "transitive": {**counts(modules, args.count_generated), "list": modules}}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("entry modules (in the order the checkpoint travels):")
    for module in ENTRY_MODULES:
        print(f"  {module}")
    print("every module reached (breadth first; * = imported by an entry module itself):")
    for module in modules:
        marks = ("*" if module in near else " ") + (
            "  (generated)" if module.startswith(GENERATED) else "")
        print(f" {marks[0]} {module_file(module).relative_to(REPO)}{marks[1:]}")
    for scope in ("direct", "transitive"):
        numbers = ", ".join(f"{name}: {value}" for name, value in result[scope].items()
                            if name != "list")
        print(f"{scope}: {numbers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
