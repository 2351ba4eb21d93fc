"""The strategies' names in Lightning's registries, without importing Lightning (and torch) before the user does.

``import lightning_ddpopt`` is light: the ``ddpopt`` command and a script's first line need neither torch nor
Lightning. The names (``Trainer(strategy="ddp_optimized")``, ``Fabric(strategy="ddp_optimized_fp16")``) must still
be in Lightning's registries by the time Lightning reads them. Each registry gets them as soon as its module has run
(at once if it already has): entries that import the strategy class only when Lightning builds one, so registering
imports nothing of this package and cannot meet a module of it half-imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["STRATEGY_NAME", "register_strategy_names", "register_with_lightning", "strategy_names"]

STRATEGY_NAME = "ddp_optimized"
_START_METHODS = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}
#: Each registry's module: the registry's name in it, the strategy class for it, and how descriptions name it.
_REGISTRIES = {
    "lightning.pytorch.strategies": ("StrategyRegistry", "lightning_ddpopt.strategy", "OptimizedDDPStrategy"),
    "lightning.fabric.strategies": (
        "STRATEGY_REGISTRY",
        "lightning_ddpopt.fabric.strategy",
        "OptimizedDDPStrategy (Fabric)",
    ),
}


def strategy_names() -> dict[str, dict[str, str]]:
    """Every name the package registers, with the strategy arguments each stands for.

    ``ddp_optimized[_spawn|_fork|_notebook]`` and the hook presets such as ``ddp_optimized_fp16``.
    """
    names = {f"{STRATEGY_NAME}{suffix}": {"start_method": method} for suffix, method in _START_METHODS.items()}
    for hook in ("fp16", "bf16"):
        for suffix in ("", "_spawn"):
            names[f"{STRATEGY_NAME}{suffix}_{hook}"] = {"comm_hook": hook, "start_method": _START_METHODS[suffix]}
    return names


def register_strategy_names(strategy: Callable[..., Any], registry: Any, what: str) -> None:
    """Register ``strategy`` under every name of :func:`strategy_names`.

    The same names in the Trainer's and Fabric's registries; ``what`` names the class in the descriptions.
    """
    for name, arguments in strategy_names().items():
        described = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
        registry.register(name, strategy, description=f"{what} with {described}", **arguments)


def register_with_lightning() -> None:
    """Register the names in each Lightning registry now if it exists, else right after its module runs."""
    for module_name, (registry_name, _, _) in _REGISTRIES.items():
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, registry_name, None) is not None:
            _register_in(module_name, module)
        elif module is None and not any(
            isinstance(finder, _AfterImport) and finder.name == module_name for finder in sys.meta_path
        ):
            sys.meta_path.insert(0, _AfterImport(module_name))
        # A module half-way through its import now, before its registry exists (imported from within Lightning's
        # own import): the strategy module registers its names when it is imported.


def _register_in(module_name: str, module: ModuleType) -> None:
    registry_name, strategy_module, what = _REGISTRIES[module_name]
    registry = getattr(module, registry_name)
    if STRATEGY_NAME not in registry:
        register_strategy_names(_Deferred(strategy_module, "OptimizedDDPStrategy"), registry, what)


class _Deferred:
    """A registry entry's strategy: imports the class when Lightning builds one."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, **init_params: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(**init_params)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the registry module ``name`` the first time it is imported and registers the names once it has run.

    It hands the import system the module's own spec with a loader of ours that runs the module's loader and then
    registers; nothing of the module's loader is changed. Once it has found the module it leaves ``sys.meta_path``.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenLoader(spec.loader)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A registry module's loader, then the names' registration; anything else (resources, source) is the loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register_in(module.__name__, module)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (a copy or an unpickled one): not the wrapped loader's to answer
            raise AttributeError(name)
        return getattr(self.loader, name)
