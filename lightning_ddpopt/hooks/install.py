"""Choosing, building and registering the strategy's comm hook on DDP, on every backend; its state's lifetime.

:class:`HookInstaller` is the strategy's one owner of the hook: it checks ``comm_hook`` at construction, picks the
hook at setup (a registry entry, a config, ``"auto"``'s measured choice, a user's callable or Lightning's
``ddp_comm_hook``), builds its state, gives hooks that run beside the backward pass a process group of their own
(and, for PowerSGD, the CPU kernels every rank can run alike), registers it through the ledger, checks that DDP
reports it attached, restores its saved state, and closes it at teardown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt._compat import attached_comm_hook
from lightning_ddpopt._groups import destroy_owned_group
from lightning_ddpopt.checkpoint import SavedRun, restore_hook_state
from lightning_ddpopt.hooks.across_islands import AcrossIslands, AcrossIslandsState, across_islands_hook
from lightning_ddpopt.hooks.auto import AUTO_HOOK, AutoConfig, HookChoice, choose_hook, measure_hook_costs
from lightning_ddpopt.hooks.base import CommHookState
from lightning_ddpopt.hooks.compression import allreduce_mean_hook, flat_fp16_note
from lightning_ddpopt.hooks.island import IslandState, island_hook
from lightning_ddpopt.hooks.powersgd import PowerSGDState
from lightning_ddpopt.hooks.registry import (
    DEFAULT_COMM_HOOK,
    TESTED_BACKENDS,
    WRITTEN_FOR_BACKENDS,
    HookSpec,
    get_hook_spec,
    hierarchical_hooks,
    validate_comm_hook,
    validate_hierarchical,
    validate_hook_callable,
)
from lightning_ddpopt.ledger import CommHook, CommLedger
from lightning_ddpopt.topology import TierGroups, Topology

__all__ = ["HookInstaller", "builtin_allreduce_suffices"]


class HookInstaller:
    """The strategy's comm hook, from its arguments to its registration on DDP and its teardown.

    Args:
        comm_hook: see :class:`~lightning_ddpopt.OptimizedDDPStrategy`.
        comm_state: the state of a callable ``comm_hook``.
        ddp_comm_hook: Lightning's name for a callable hook (with ``ddp_comm_state`` and ``ddp_comm_wrapper``).
        ddp_comm_state: its state.
        ddp_comm_wrapper: a wrapper applied around ``ddp_comm_hook``.
        hierarchical: see :class:`~lightning_ddpopt.OptimizedDDPStrategy`.

    Raises:
        ValueError, TypeError: at construction, for arguments that cannot work together, naming them.
    """

    def __init__(
        self,
        comm_hook: object,
        comm_state: object | None,
        ddp_comm_hook: Callable | None,
        ddp_comm_state: object | None,
        ddp_comm_wrapper: Callable | None,
        hierarchical: bool | Literal["auto"] = "auto",
    ) -> None:
        #: The registry entry of the hook (``"auto"``'s once it has chosen); ``None`` for a callable or none.
        self.spec: HookSpec | None
        self.spec, self._callable = validate_comm_hook(comm_hook, comm_state, ddp_comm_hook)
        self.hierarchical = validate_hierarchical(hierarchical, comm_hook, self.spec, ddp_comm_hook)
        #: The intra- and cross-node groups of a two-tier sync (``None`` for a flat one).
        self.tiers: TierGroups | None = None
        if ddp_comm_hook is not None:
            validate_hook_callable(ddp_comm_hook, "ddp_comm_hook")
        if ddp_comm_wrapper is not None and ddp_comm_hook is None:
            raise ValueError(
                f"ddp_comm_wrapper={ddp_comm_wrapper!r} wraps ddp_comm_hook, which is not given; pass "
                "ddp_comm_hook too, or use comm_hook="
            )
        self.auto = comm_hook == AUTO_HOOK or isinstance(comm_hook, AutoConfig)
        self._auto_config = comm_hook if isinstance(comm_hook, AutoConfig) else AutoConfig()
        self._comm_state_arg = comm_state
        self._ddp_hook, self._ddp_state, self._ddp_wrapper = ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper
        self.comm_state: object | None = None
        self.comm_hook_name: str | None = None
        self.hook_choice: HookChoice | None = None
        self.registered: CommHook | None = None
        self._owns_state = False
        self._registered_state: object | None = None
        self._group: dist.ProcessGroup | None = None

    def install(
        self,
        model: DistributedDataParallel,
        *,
        backend: str,
        ledger: CommLedger,
        device: torch.device,
        world_size: int,
        loss_scale: Callable[[], torch.Tensor | None],
        own_group: Callable[[], dist.ProcessGroup],
        reused_choice: HookChoice | None,
        topology: Topology | None = None,
        new_group: Callable[[list[int]], dist.ProcessGroup] | None = None,
        island: tuple[Callable[[], dist.ProcessGroup | None], Callable[[], bool]] | None = None,
        across: AcrossIslands | None = None,
        observed: bool = True,
    ) -> None:
        """Build the hook and register it on ``model`` (none: DDP's built-in allreduce).

        ``own_group`` makes a process group over the model's ranks for a hook that runs beside the backward pass;
        ``reused_choice`` is a checkpoint's ``"auto"`` decision that still applies; ``topology`` (the ranks of each
        node) decides whether the sync is hierarchical, and ``new_group`` makes its groups (on the strategy's backend,
        with its timeout). ``island``: local SGD's island group and whether it trains apart now; the hook is then
        wrapped in :func:`~lightning_ddpopt.hooks.island.island_hook`. ``across``: per-step fault tolerance's
        average across the islands, which :func:`~lightning_ddpopt.hooks.across_islands.across_islands_hook` runs
        on the hook's result. ``observed``: something reads the ledger's
        syncs (a measuring callback); without it, ``comm_hook="allreduce"`` on NCCL leaves DDP's own C++
        allreduce in place (:func:`builtin_allreduce_suffices`).
        """
        self._check_post_local_sgd(device)
        if self.choosing:
            self.spec = get_hook_spec(self._choose(model, device, world_size, reused_choice).name)
        # Decided before the hook is built: a two-tier int8 sync needs no exchange group of its own.
        tiered = self.spec is not None and self._two_tiers(topology, model, backend)
        wrapped = island is not None or across is not None
        if builtin_allreduce_suffices(self.spec, backend, tiered=tiered, island=wrapped, observed=observed):
            rank_zero_info(
                f"ddpopt: comm_hook='allreduce' on {backend}: DDP's own C++ allreduce syncs the gradients (nothing "
                "needs a hook of ours: no measuring callback, manual optimization, two-tier sync or local "
                "SGD); the ledger sees no sync"
            )
            return
        hook = self._build(model, backend, ledger, device, loss_scale, own_group, beside_backward=not tiered)
        if hook is not None and self.spec is None:
            self._two_tiers(topology, model, backend)  # says why a user's hook stays flat
        if self.spec is not None and self.spec.name == "fp16" and not tiered:
            note = flat_fp16_note(world_size, chosen_by_auto=self.auto)
            if note is not None:
                rank_zero_warn(note)
        if tiered:
            # The registry entry's two-tier form on the tiers' groups, with the flat state's config.
            assert topology is not None and new_group is not None and isinstance(self.comm_state, CommHookState)
            assert self.spec is not None and self.spec.two_tier is not None
            self.tiers = TierGroups(topology, new_group)
            state = self.spec.two_tier.make_state(
                flat=self.comm_state, tiers=self.tiers, process_group=model.process_group, ledger=ledger, device=device
            )
            state.bind_module(model.module)
            state.loss_scale = loss_scale
            self.comm_state, hook = state, self.spec.two_tier.hook
        self._registered_state = self.comm_state
        if wrapped:
            if hook is None:  # every step syncs (in the island, the warm-up, across islands): DDP's allreduce too
                hook = allreduce_mean_hook
                self._registered_state = CommHookState(process_group=model.process_group, ledger=ledger)
            if island is not None:
                self._registered_state = IslandState(
                    ledger=ledger, island=island[0], local=island[1], hook=hook, hook_state=self._registered_state
                )
                hook = island_hook
            if across is not None:
                # Per step across the fault-tolerant islands: the island's sync, then the islands' average of its
                # result, beside the backward pass.
                ignored: set[str] = set(getattr(model, "parameters_to_ignore", ()))
                synced = [p for name, p in model.module.named_parameters() if p.requires_grad and name not in ignored]
                across.bind(synced, device)
                if across.group is None and world_size > 1:
                    across.group = own_group()
                self._registered_state = AcrossIslandsState(
                    ledger=ledger, hook=hook, hook_state=self._registered_state, across=across
                )
                hook = across_islands_hook
        if hook is None:
            return
        if backend not in TESTED_BACKENDS:
            why = WRITTEN_FOR_BACKENDS.get(backend, "it is neither tested nor written for")
            rank_zero_warn(
                f"ddpopt: comm hook {self.comm_hook_name!r} registered on backend {backend!r}, on which this release "
                f"has not run its tests ({', '.join(TESTED_BACKENDS)} only): {why}; check its results."
            )
        self.registered = ledger.record_hook(hook)
        self.register(model)
        attached = attached_comm_hook(model)
        if attached != hook.__qualname__:
            raise RuntimeError(
                f"ddpopt: registered comm hook {hook.__qualname__!r} but DDP reports {attached!r} attached"
            )

    def _two_tiers(self, topology: Topology | None, model: DistributedDataParallel, backend: str) -> bool:
        """Whether this run's sync is hierarchical; says why on rank 0 (every rank decides alike)."""
        if self.hierarchical is False or topology is None or topology.world_size == 1:
            return False
        why = "several nodes with several ranks each, as many on every node"
        if not topology.tiered:
            layout = "one node" if topology.num_nodes == 1 else topology.describe()
            if self.hierarchical is True:
                rank_zero_warn(f"ddpopt: hierarchical=True needs {why}; this run has {layout}: the sync is flat")
            elif topology.num_nodes > 1 and not topology.uniform:
                rank_zero_info(f"ddpopt: flat sync over {layout}: a hierarchical one needs {why}")
            return False
        flat = f"ddpopt: flat sync over {topology.describe()}: "
        if dist.get_process_group_ranks(model.process_group) != sorted(r for node in topology.nodes for r in node):
            rank_zero_warn(flat + "DDP's process_group is not every rank, and the tiers are made over every rank")
            return False
        form = self.spec.two_tier if self.spec is not None else None
        if form is None:
            # hierarchical=True with another hook is refused at construction; here: "auto"'s choice, or a hook
            # whose registry entry declares no two-tier form.
            name = self.spec.name if self.spec is not None else self.comm_hook_name
            rank_zero_info(
                flat + f"comm hook {name!r} has no hierarchical form (those with one: "
                f"{', '.join(hierarchical_hooks())})"
            )
            return False
        if self.hierarchical == "auto" and backend not in TESTED_BACKENDS:
            rank_zero_info(
                flat + f"hierarchical='auto' keeps {backend}'s own sync, since the two-tier one has not run on "
                f"{backend} yet (hierarchical=True uses it)"
            )
            return False
        if self.hierarchical == "auto" and form.flat_when_auto is not None:
            rank_zero_info(flat + form.flat_when_auto)
            return False
        rank_zero_info(
            f"ddpopt: hierarchical sync over {topology.describe()}: each bucket summed inside the node in its own "
            f"precision, 1/{topology.ranks_per_node} of it per rank sent between nodes in {form.crossing}, gathered "
            f"inside the node (hierarchical={self.hierarchical!r})"
        )
        return True

    @property
    def choosing(self) -> bool:
        """Whether ``comm_hook="auto"`` has yet to choose (it chooses once, at the first fit's setup)."""
        return self.auto and self.spec is None

    @property
    def results_identical(self) -> bool:
        """Whether every rank receives the same synchronised gradients: DDP's allreduce or a registry hook's.

        A user's callable (``comm_hook`` or ``ddp_comm_hook``) may do anything (e.g. post-local SGD's skipped syncs).
        """
        return self._callable is None and self._ddp_hook is None

    def _check_post_local_sgd(self, device: torch.device) -> None:
        """Refuse a post-local SGD state that would fail mid-training on this device."""
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

        state = self._ddp_state
        if (
            isinstance(state, PostLocalSGDState)
            and state.subgroup is None
            and state.post_local_gradient_allreduce
            and device.type != "cuda"
        ):
            raise ValueError(
                "ddp_comm_state=PostLocalSGDState(subgroup=None, post_local_gradient_allreduce=True) makes torch "
                f"build one subgroup per node from the CUDA device count, which is 0 on {device.type}, and fails "
                "once local SGD starts. Pass post_local_gradient_allreduce=False (no gradient sync between "
                "averagings) or an explicit subgroup."
            )

    def register(self, model: DistributedDataParallel) -> None:
        """Register the built hook on ``model`` (again, on a model wrapped anew with other buckets)."""
        if self.registered is not None:
            model.register_comm_hook(self._registered_state, self.registered)

    def _choose(
        self, model: DistributedDataParallel, device: torch.device, world_size: int, reused: HookChoice | None
    ) -> HookChoice:
        if reused is not None and reused.name in self._auto_config.candidates:
            self.hook_choice = reused
            rank_zero_info(f"ddpopt: comm_hook='auto' reuses the checkpoint's choice {reused.name!r}")
            return reused
        if world_size > 1:
            config = self._auto_config
            costs = measure_hook_costs(
                model.module, model.process_group, device, candidates=config.candidates, lookup=get_hook_spec
            )
            self.hook_choice = choose_hook(costs, config)
        else:
            self.hook_choice = HookChoice("allreduce", {}, "one process: nothing to communicate")
        rank_zero_info(f"ddpopt: comm_hook='auto' chose {self.hook_choice.name!r}: {self.hook_choice.reason}")
        return self.hook_choice

    def _build(
        self,
        model: DistributedDataParallel,
        backend: str,
        ledger: CommLedger,
        device: torch.device,
        loss_scale: Callable[[], torch.Tensor | None],
        own_group: Callable[[], dist.ProcessGroup],
        beside_backward: bool = True,
    ) -> CommHook | None:
        if self.spec is not None:
            reason = self.spec.unsupported_reason(backend)
            if reason is not None:
                raise ValueError(f"comm_hook={self.spec.name!r} cannot run on backend {backend!r}: {reason}")
            state = self.spec.build(model.process_group, ledger)
            self.comm_state, self._owns_state, self.comm_hook_name = state, True, self.spec.name
            state.loss_scale = loss_scale
            state.bind_module(model.module)
            if device.type == "cpu" and beside_backward:
                self._group = state.run_beside_backward(own_group, model.process_group)
            return self.spec.hook
        hook: Callable | None = self._callable
        self.comm_state, self._owns_state = self._comm_state_arg, False
        if hook is None and self._ddp_hook is not None:
            hook, self.comm_state = self._ddp_hook, self._ddp_state
            if self._ddp_wrapper is not None:
                hook = self._ddp_wrapper(hook)
        self.comm_hook_name = hook.__qualname__ if hook is not None else None
        if isinstance(self.comm_state, CommHookState):
            self.comm_state.bind_module(model.module)
            if self.comm_state.ledger is None:
                self.comm_state.ledger = ledger
            if self.comm_state.loss_scale is None:
                self.comm_state.loss_scale = loss_scale
        return hook

    def fit_to_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve what depends on the optimizers: PowerSGD's ``max_error="auto"`` bound (logged on rank 0)."""
        state = self.comm_state
        if isinstance(state, PowerSGDState) and state.config.max_error == "auto":
            state.fit_bound_to(optimizers)
            names = ", ".join(type(optimizer).__name__ for optimizer in optimizers) or "no optimizer"
            rank_zero_info(
                f"ddpopt: PowerSGD's error bound is {state.error_bound:g} for {names} (max_error='auto'); every "
                f"matrix's rank starts at {state.rank}, doubles, up to {state.config.max_rank}, while its error is "
                "above it, and halves again when half would stay well under it"
            )

    def restore(self, saved: SavedRun, world_size: int, rank: int) -> None:
        """Load this rank's saved hook state; warn (on rank 0) about what could not be restored."""
        if not saved.has_hook_states:
            return
        if isinstance(self.comm_state, CommHookState):
            problem = restore_hook_state(
                self.comm_state, saved, hook_name=self.comm_hook_name, world_size=world_size, rank=rank
            )
        else:
            problem = (
                f"the checkpoint holds state of comm hook {saved.comm_hook!r}; this run's hook "
                f"{self.comm_hook_name!r} keeps no state of this package's kind, so the saved state is not used"
            )
        if problem is not None:
            rank_zero_warn(f"ddpopt: {problem}")

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state for a checkpoint; empty for stateless hooks (the same answer on every rank)."""
        return self.comm_state.state_dict() if isinstance(self.comm_state, CommHookState) else {}

    def close(self) -> None:
        """Stop the hook's worker threads and destroy its group; the state keeps its figures.

        Nothing of ours may keep a process group alive past Lightning's exit-time ``destroy_process_group``: a gloo
        group destroyed later, during interpreter shutdown, can abort the process with its threads running. The
        state falls back to the default group (for a checkpoint saved after fit).
        """
        state = self.comm_state
        if not self._owns_state or not isinstance(state, CommHookState):
            return
        if not state.close():
            rank_zero_warn(
                f"ddpopt: {self.comm_hook_name}'s worker thread is still busy after a minute; its group is kept"
            )
            return
        state.release_group()
        destroy_owned_group(self, "_group")
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None


def builtin_allreduce_suffices(
    spec: HookSpec | None, backend: str, *, tiered: bool, island: bool, observed: bool
) -> bool:
    """Whether DDP's own allreduce does all ``comm_hook="allreduce"`` would: on NCCL, with nothing needing our hook.

    Our ``allreduce`` hook is DDP's mean allreduce run from Python, reporting each bucket to the ledger; on NCCL that is
    a Python call and a ledger entry per bucket for nothing when no callback reads the ledger, and no
    two-tier sync or local SGD island wraps it. On gloo it stays: the CPU tests run every path through it.
    """
    return (
        backend == "nccl" and spec is not None and spec.name == DEFAULT_COMM_HOOK and not (tiered or island or observed)
    )
