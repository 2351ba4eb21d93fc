"""The package's shape, as the design page states it: no import circle, 8 import floors, private APIs in ``_compat``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_ddpopt import _compat

pytestmark = pytest.mark.quick

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_ddpopt"
#: Attributes without a leading underscore that torch documents nowhere: set through ``_compat`` only.
UNDOCUMENTED = {"require_backward_grad_sync", "require_forward_param_sync"}
#: What the strategies read of the ``DDPStrategy`` they subclass, declared and checked at construction in ``_compat``.
INHERITED = set(_compat.DDP_STRATEGY_INTERNALS) | set(_compat.FABRIC_DDP_STRATEGY_ATTRIBUTES)


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (its body never runs; an ``else`` branch does)."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules ``name`` imports when it runs, function-level imports included.

    Imports under ``TYPE_CHECKING`` name a collaborator's type (a state holds the ledger it calls, a view names the
    core it reads); they never run, so they cannot close a circle.
    """
    found = set()
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if _type_checking(node)
        for statement in node.body  # type: ignore[attr-defined]
        for inner in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: from the package of ``name``
                package = name.split(".")[: -node.level] if not name.endswith("__init__") else name.split(".")
                base = ".".join([*package, node.module])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    # A package imports what it re-exports; a circle through an __init__ is Python's own order, not ours.
    packages = {name for name in modules if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}
    graph = {name: {t for t in targets if t not in packages} for name, targets in graph.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles


#: The design page's bound on the import graph's depth (module-level imports; see "Import floors").
MAX_FLOORS = 8


def _module_level_imports(name: str, tree: ast.Module, modules: dict[str, ast.Module], packages: set[str]) -> set[str]:
    """The package modules ``name`` imports when it runs: not under ``TYPE_CHECKING``, not inside a function.

    A name imported from a package is the module the package's ``__init__`` takes it from.
    """

    def statements(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
        found: list[ast.Import | ast.ImportFrom] = []
        for node in body:
            if _type_checking(node):
                found += statements(node.orelse)  # type: ignore[attr-defined]
                continue
            if isinstance(node, ast.If | ast.Try):
                found += statements(node.body) + statements(node.orelse)
                for handler in getattr(node, "handlers", []):
                    found += statements(handler.body)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
        return found

    def pairs(module: str, tree: ast.Module) -> list[tuple[str, str | None]]:
        out: list[tuple[str, str | None]] = []
        for node in statements(tree.body):
            if isinstance(node, ast.Import):
                out += [(alias.name, None) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = module.split(".") if module in packages else module.split(".")[:-1]
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                out += [(base, alias.name) for alias in node.names]
        return out

    found = set()
    for base, alias in pairs(name, tree):
        if alias is not None and f"{base}.{alias}" in modules:
            target: str | None = f"{base}.{alias}"
        elif base in packages and alias is not None:
            target = next((b for b, a in pairs(base, modules[base]) if a == alias and b in modules), None)
        else:
            target = base if base in modules else None
        if target is not None and target not in packages and target != name:
            found.add(target)
    return found


def test_the_import_graph_is_at_most_eight_floors_deep():
    modules = _modules()
    packages = {name for name in modules if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}
    graph = {
        name: _module_level_imports(name, tree, modules, packages)
        for name, tree in modules.items()
        if name not in packages
    }
    floors: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 1 + max((floor(target) for target in graph[name]), default=0)
        return floors[name]

    deepest = max(graph, key=floor)
    chain = [deepest]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=floor))
    assert floor(deepest) <= MAX_FLOORS, " -> ".join(chain)
    assert floor("lightning_ddpopt.strategy") == floor("lightning_ddpopt.fabric.strategy") == MAX_FLOORS


def _defined_by_us(modules: dict[str, ast.Module]) -> set[str]:
    """Every name the package defines: functions, classes, fields, ``self.x`` attributes, variables, arguments."""
    names = set()
    for tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def _lightnings() -> set[str]:
    """The private names of the Lightning and Fabric ``DDPStrategy`` our strategies subclass: theirs, not ours."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy

    names: set[str] = set()
    for base in (DDPStrategy, FabricDDPStrategy):
        names |= set(dir(base)) | set(vars(base()))
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private(name: str, ours: set[str]) -> bool:
    return name in UNDOCUMENTED or (name.startswith("_") and not name.startswith("__") and name not in ours)


def private_accesses(modules: dict[str, ast.Module]) -> list[str]:
    """Where a module other than ``_compat`` touches a private attribute of torch, Lightning or Python."""
    # A private attribute of the DDPStrategy a strategy subclasses is Lightning's even where the strategy sets it.
    ours = _defined_by_us(modules) - UNDOCUMENTED - _lightnings()
    found = []
    for name, tree in modules.items():
        if name == "lightning_ddpopt._compat":
            continue
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and _private(node.attr, ours):
                on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
                on_super = (
                    isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "super"
                )
                inherited = (on_self or on_super) and node.attr in INHERITED
                if not inherited:
                    found.append(f"{where} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lightning_ddpopt"):
                private_module = any(
                    part.startswith("_") and not part.startswith("__") for part in node.module.split(".")
                )
                for alias in node.names:
                    if private_module or alias.name.startswith("_"):
                        found.append(f"{where} from {node.module} import {alias.name}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value, ours)
            ):
                found.append(f"{where} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_private_apis_are_touched_in_compat_only():
    assert private_accesses(_modules()) == []


def test_the_scan_finds_a_private_access():
    # The scan above must be able to fail: each kind of access it looks for, in a module of its own.
    source = """
from torch.distributed.distributed_c10d import _get_default_store
import torch

def f(model, loop):
    model.require_backward_grad_sync = False
    loop._broadcast_sigterm_tensor = print
    return getattr(torch.cpu, "_is_avx512_bf16_supported", None)

class Strategy:
    def __init__(self):
        self._launcher = None  # Lightning's DDPStrategy's, though set on self here
"""
    found = private_accesses({**_modules(), "lightning_ddpopt.example": ast.parse(source)})
    assert sorted(entry.split(" ", 1)[1] for entry in found if entry.startswith("lightning_ddpopt.example:")) == sorted(
        [
            "from torch.distributed.distributed_c10d import _get_default_store",
            ".require_backward_grad_sync",
            "._broadcast_sigterm_tensor",
            "getattr(..., '_is_avx512_bf16_supported')",
            "._launcher",
        ]
    )


def test_type_hints_resolve_on_what_a_config_file_builds():
    """``typing.get_type_hints`` (what LightningCLI's parser reads) works on the strategies, configs and callbacks.

    A hook's state names the ledger only for the type checker: importing the ledger where the states live would put
    the hooks a floor higher (the graph above); states are built by the strategy, not from a config file.
    """
    import dataclasses
    import typing

    import lightning_ddpopt
    import lightning_ddpopt.callbacks
    import lightning_ddpopt.fabric
    import lightning_ddpopt.hooks
    import lightning_ddpopt.localsgd
    from lightning_ddpopt.hooks.base import CommHookState, TwoTierForm

    modules = (lightning_ddpopt, lightning_ddpopt.callbacks, lightning_ddpopt.fabric, lightning_ddpopt.hooks)
    classes = {
        value
        for module in (*modules, lightning_ddpopt.localsgd)
        for value in (getattr(module, name) for name in module.__all__)
        if isinstance(value, type) and not issubclass(value, CommHookState | TwoTierForm)
    }
    built = {"OptimizedDDPStrategy", "PowerSGDConfig", "Int8Config", "LocalSGDConfig", "AMPMonitor", "FaultTolerance"}
    assert built <= {cls.__name__ for cls in classes}
    for cls in classes - {lightning_ddpopt.fabric.Monitor}:  # Fabric's Monitor is built in the loop, by code
        hints = typing.get_type_hints(cls.__init__)
        if dataclasses.is_dataclass(cls):
            assert set(typing.get_type_hints(cls)) >= {field.name for field in dataclasses.fields(cls)}, cls
        assert "return" in hints or cls.__init__ is object.__init__, cls
