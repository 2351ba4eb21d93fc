"""The strategies' names in Lightning's registries, without importing Lightning (and torch) before the user does.

``import lightning_ddpopt`` is light: the ``ddpopt`` command and a script's first line need neither torch nor
Lightning. The names (``Trainer(strategy="ddp_optimized")``, ``Fabric(strategy="ddp_optimized_fp16")``) must still
be registered by the time Lightning reads them, so they are registered as soon as Lightning is imported: at once if it
already is, else right after ``lightning.pytorch`` has run (``lightning.fabric`` imports it too). Each strategy module
registers its own names when it has been imported; registering here means importing them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["register_with_lightning"]

_LIGHTNING = "lightning.pytorch"


def register_with_lightning() -> None:
    """Register the strategies' names now if Lightning is imported, else once it is (once per process)."""
    module = sys.modules.get(_LIGHTNING)
    if module is not None and not getattr(module.__spec__, "_initializing", False):
        _register()
    elif module is None and not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_LIGHTNING, _register))


def _register() -> None:
    # A module already being imported (the user's own import of it brought Lightning in) registers at its end.
    import lightning_ddpopt.fabric.strategy  # noqa: F401
    import lightning_ddpopt.strategy  # noqa: F401


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` once the module ``name`` has been executed, the first time it is imported; then steps aside."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            try:
                self.then()
            except Exception as error:  # Lightning itself must import whatever happens here
                warnings.warn(
                    f"lightning_ddpopt could not register its strategy names with Lightning "
                    f"({type(error).__name__}: {error}); import lightning_ddpopt.strategy to see why",
                    RuntimeWarning,
                    stacklevel=2,
                )

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
