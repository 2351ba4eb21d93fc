"""What both strategies, the Trainer's and Fabric's, do alike with their core: each step written once.

:class:`CoreStrategy` is mixed into both (beside Lightning's or Fabric's ``DDPStrategy``); each strategy says *when* a
step runs (the Trainer's and Fabric's hooks differ), this module says *what* it does. What it reads of the
``DDPStrategy`` it is mixed with is :class:`_DDPStrategyLike`; the private parts of it are checked at construction
by :func:`lightning_ddpopt._compat.check_ddp_strategy_internals`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import ClusterEnvironment
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt.core import StrategyCore
from lightning_ddpopt.fault_tolerance.driver import FaultTolerantSteps
from lightning_ddpopt.measuring import CoreViews

__all__ = ["CoreStrategy"]


class _DDPStrategyLike(Protocol):
    """What :class:`CoreStrategy` reads of the strategy it is mixed into (Lightning's or Fabric's ``DDPStrategy``)."""

    _core: StrategyCore
    _ddp_kwargs: dict[str, Any]

    @property
    def _timeout(self) -> timedelta | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def bucket_layout(self) -> tuple[int, ...] | None: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    @property
    def ledger(self) -> Any: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def _get_process_group_backend(self) -> str: ...

    def _loss_scale(self) -> torch.Tensor | None: ...


class CoreStrategy(CoreViews):
    """The steps both strategies take with their :class:`~lightning_ddpopt.core.StrategyCore`, and its views."""

    def _start_core(self: _DDPStrategyLike) -> None:
        """Once the process group exists: the core learns this rank's place (cores, nodes, ledger)."""
        self._core.start(
            self.root_device,
            local_rank=self.local_rank,
            local_world_size=self.num_processes,
            node_rank=self.node_rank,
            world_size=self.world_size,
            rank=self.global_rank,
        )

    def _name_run(self: _DDPStrategyLike) -> None:
        """Name this run's checkpoint meetings on the store (it outlives a run in the same processes): every rank."""
        if self.world_size > 1:
            self._core.name_run(self.broadcast(secrets.token_hex(8)))

    def _install_hook(self: _DDPStrategyLike, model: DistributedDataParallel, measured: bool = True) -> None:
        """Register the hook on the freshly wrapped ``model`` (see :meth:`StrategyCore.install`)."""
        self._core.install(
            model,
            backend=self._get_process_group_backend(),
            timeout=self._timeout,
            device=self.root_device,
            loss_scale=self._loss_scale,
            measured=measured,
        )

    def _log_final_layout(self: _DDPStrategyLike, model: object, say: Callable[[str], None]) -> None:
        """At the end of training: DDP's bucket layout, if no step logged it yet."""
        if self.bucket_layout is None and isinstance(model, DistributedDataParallel):
            self._core.buckets.log_layout(self.ledger, say, self._core.local_phase, final=True)

    def _join_islands(
        self: _DDPStrategyLike,
        ft: FaultTolerantSteps,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        """Join the fault-tolerant quorum as one island: this job's ranks, its store, its training state."""
        environment = self.cluster_environment
        assert environment is not None
        ft.setup(
            self.global_rank,
            self.world_size,
            (environment.main_address, environment.main_port),
            self.root_device,
            state_dict=state_dict,
            load_state_dict=load_state_dict,
            broadcast=self.broadcast,
        )
