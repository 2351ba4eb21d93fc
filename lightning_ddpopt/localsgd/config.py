"""How local SGD syncs: :class:`LocalSGDConfig`, its presets, and its checks against the strategy's arguments."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_ddpopt._validate import is_real_number, require_int

__all__ = ["INT8_BLOCK", "OUTER_DEFAULTS", "PROVISIONAL_SYNC_EVERY", "REPLICA_LAYOUTS", "WIRE_DTYPES", "LocalSGDConfig"]

Compression = Literal["fp32", "fp16", "bf16", "int8"]
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_COMPRESSIONS = (*WIRE_DTYPES, "int8")
#: int8 blocks of the parameter change, each with its fp32 scale (as the int8 gradient hook's default).
INT8_BLOCK = 1024
BufferSync = Literal["average", "broadcast"]
#: ``LocalSGDConfig.replica``'s named layouts (or a number of ranks per replica).
REPLICA_LAYOUTS = ("auto", "rank", "node")
#: ``sync_every="auto"``: the H of the windows trained before the ranks choose it (the first after the warm-up, whose
#: steps and sync are measured).
PROVISIONAL_SYNC_EVERY = 16
#: ``outer_lr="auto"`` and ``outer_momentum="auto"`` (``diloco()``'s defaults): ``(outer_lr, outer_momentum)`` for an
#: adaptive inner optimizer (Adam and its kin, as PowerSGD's ``max_error="auto"`` tells them) and for others, chosen by
#: time to stock's validation loss (``benchmarks/time_to_loss.py``; the sweep's figures are in the local SGD guide,
#: "The outer step for the inner optimizer"). The sweep found the same values for both; the rows stay apart.
OUTER_DEFAULTS: dict[str, tuple[float, float]] = {"adaptive": (0.4, 0.8), "other": (0.4, 0.8)}


@dataclass(kw_only=True)
class LocalSGDConfig:
    """How often and how the ranks sync their parameters; see the module doc.

    Args:
        sync_every: ``H``, optimizer steps between two parameter syncs (>= 1; 1 with ``outer_lr=1`` and no momentum
            is parameter averaging after every step), or ``"auto"``: the first window after the warm-up has
            :data:`PROVISIONAL_SYNC_EVERY` steps, whose step time (the slowest rank's) and sync time (the least over
            the ranks) choose H through :func:`lightning_ddpopt.costmodel.choose_sync_every` at its sync, the same on
            every rank, for the rest of the run (logged on rank 0, saved in checkpoints;
            ``strategy.local_sgd.sync_every`` is the H in use).
        warmup_steps: ordinary synchronous DDP steps first (gradients all-reduced, through the strategy's hook).
        outer_lr: the outer optimizer's learning rate (> 0); 1 without momentum is plain averaging. ``"auto"``:
            :data:`OUTER_DEFAULTS`' for the run's inner optimizers, resolved at setup (see :meth:`fit_outer`).
        outer_momentum: the outer optimizer's momentum, in [0, 1), or ``"auto"`` (as ``outer_lr``).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``; with ``outer_momentum="auto"``, if it resolves to
            more than 0).
        compression: how the parameter change is sent between the replicas: all-reduced in ``"fp32"``, ``"fp16"``
            or ``"bf16"``, or ``"int8"``: blocks of 1024 values quantised to int8 with an fp32 scale each, exchanged
            in the int8 comm hook's reduce-scatter shape (each replica's chunks to their owners, summed there in fp32
            and quantised again, then gathered), every rank dequantising the same bytes. Like a ring all-reduce of a
            quarter of the fp32 bytes at any number of replicas, with buffers of about a byte per parameter.
        buffers: ``"average"`` floating-point buffers at each sync, or ``"broadcast"`` rank 0's.
        overlap_steps: ``tau``, inner steps the parameter change is in flight while the ranks train on (0: they wait for
            it). With ``tau >= 1`` (< ``sync_every``) the all-reduce (int8: the all-gather) starts at the sync point
            and is applied ``tau`` steps later (Streaming DiLoCo's overlap, Douillard et al. 2025): the
            outer step moves the anchor, the same on every rank, and each rank's parameters become
            ``overlap_mixing x`` its own ``+ (1 - overlap_mixing) x`` the new anchor, so they differ by what each
            rank learned meanwhile until the next sync.
        overlap_mixing: ``alpha`` in [0, 1], the weight of a rank's own parameters when an overlapped sync is applied
            (0.5 as in Streaming DiLoCo).
        replica: which ranks train together as one replica (an *island*): ``"rank"`` (each rank its own),
            ``"node"`` (the ranks of a node), a number ``k`` (ranks ``0..k-1``, ``k..2k-1``, ...), or ``"auto"``: a
            node when the run spans several nodes with several ranks each, else a rank; the choice is logged with
            the reason at setup. The ranks of an island all-reduce their gradients every step (in fp32, over the
            fast link inside it); the islands sync their parameters every ``sync_every`` steps, each rank of an
            island carrying 1/k of the parameters (its shard of the anchor and outer momentum) across the islands.
    """

    sync_every: int | Literal["auto"] = 16
    warmup_steps: int = 0
    outer_lr: float | Literal["auto"] = 1.0
    outer_momentum: float | Literal["auto"] = 0.0
    nesterov: bool = False
    compression: Compression = "fp32"
    buffers: BufferSync = "average"
    overlap_steps: int = 0
    overlap_mixing: float = 0.5
    replica: Literal["auto", "rank", "node"] | int = "auto"

    def __post_init__(self) -> None:
        if self.sync_every != "auto":
            require_int(
                "LocalSGDConfig sync_every",
                self.sync_every,
                1,
                " (optimizer steps between parameter syncs) or 'auto' (chosen from the first window's step and sync)",
            )
        require_int("LocalSGDConfig warmup_steps", self.warmup_steps, 0, " (synchronous steps first)")
        lr = self.outer_lr
        if lr != "auto" and (not is_real_number(lr) or not math.isfinite(lr) or lr <= 0):
            raise ValueError(f"LocalSGDConfig outer_lr={lr!r} must be a positive, finite number or 'auto'")
        momentum = self.outer_momentum
        if momentum != "auto" and (not is_real_number(momentum) or not 0 <= momentum < 1):
            raise ValueError(f"LocalSGDConfig outer_momentum={momentum!r} must be in [0, 1) or 'auto'")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"LocalSGDConfig nesterov={self.nesterov!r} must be True or False")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("LocalSGDConfig nesterov=True needs outer_momentum > 0 (0.9 in DiLoCo)")
        if self.compression not in _COMPRESSIONS:
            raise ValueError(
                f"LocalSGDConfig compression={self.compression!r} is not valid; choose one of {list(_COMPRESSIONS)}"
            )
        if self.buffers not in ("average", "broadcast"):
            raise ValueError(
                f"LocalSGDConfig buffers={self.buffers!r} is not valid; choose one of ['average', 'broadcast']"
            )
        require_int("LocalSGDConfig overlap_steps", self.overlap_steps, 0, " (inner steps a sync is in flight)")
        if self.overlap_steps >= self.first_sync_every:
            window = "" if self.sync_every != "auto" else f" (its first window of {PROVISIONAL_SYNC_EVERY} steps)"
            raise ValueError(
                f"LocalSGDConfig overlap_steps={self.overlap_steps} must be below sync_every={self.sync_every!r}"
                f"{window}: a sync is applied before the next one starts"
            )
        if not is_real_number(self.overlap_mixing) or not 0 <= self.overlap_mixing <= 1:
            raise ValueError(f"LocalSGDConfig overlap_mixing={self.overlap_mixing!r} must be in [0, 1]")
        if isinstance(self.replica, bool) or not (
            self.replica in REPLICA_LAYOUTS or (isinstance(self.replica, int) and self.replica >= 1)
        ):
            raise ValueError(
                f"LocalSGDConfig replica={self.replica!r} is not valid; choose one of {list(REPLICA_LAYOUTS)} or a "
                "number of ranks per replica (>= 1)"
            )

    @property
    def first_sync_every(self) -> int:
        """The H of the first window after the warm-up: ``sync_every``, or with ``"auto"`` the provisional one."""
        return PROVISIONAL_SYNC_EVERY if self.sync_every == "auto" else self.sync_every

    @property
    def outer_auto(self) -> bool:
        """Whether ``outer_lr`` or ``outer_momentum`` is ``"auto"`` (left to the inner optimizers)."""
        return "auto" in (self.outer_lr, self.outer_momentum)

    def fit_outer(self, adaptive: bool) -> LocalSGDConfig:
        """This config with ``outer_lr`` and ``outer_momentum`` ``"auto"`` resolved; itself if neither is.

        The values are :data:`OUTER_DEFAULTS`' row for the inner optimizers; ``nesterov`` stays on only if the
        momentum is above 0.

        Args:
            adaptive: whether an inner optimizer is adaptive (Adam and its kin:
                :func:`lightning_ddpopt.hooks.powersgd_rank.is_adaptive`).
        """
        if not self.outer_auto:
            return self
        lr, momentum = OUTER_DEFAULTS["adaptive" if adaptive else "other"]
        lr = lr if self.outer_lr == "auto" else self.outer_lr
        momentum = momentum if self.outer_momentum == "auto" else self.outer_momentum
        return dataclasses.replace(self, outer_lr=lr, outer_momentum=momentum, nesterov=self.nesterov and momentum > 0)

    @classmethod
    def diloco(cls, sync_every: int | Literal["auto"] = 16, **overrides: Any) -> LocalSGDConfig:
        """DiLoCo: outer SGD with Nesterov momentum, changes in fp16.

        The outer learning rate and momentum are ``"auto"``: :data:`OUTER_DEFAULTS`' for the run's inner optimizer
        (0.4 and 0.8 for both kinds, chosen by time to stock's loss; Douillard et al. use 0.7 and 0.9), resolved at
        setup. OpenDiLoCo all-reduces the parameter
        change in fp16 without a loss in quality; pass ``compression="fp32"`` (or ``"int8"``) to change that.

        Args:
            sync_every: H, optimizer steps between parameter syncs, or ``"auto"``.
            **overrides: any other field of the config, e.g. ``overlap_steps=8`` or ``outer_lr=0.5``.
        """
        settings: dict[str, Any] = {
            "outer_lr": "auto",
            "outer_momentum": "auto",
            "nesterov": True,
            "compression": "fp16",
            **overrides,
        }
        return cls(sync_every=sync_every, **settings)

    @classmethod
    def post_local_sgd(cls, sync_every: int | Literal["auto"] = 16, **overrides: Any) -> LocalSGDConfig:
        """Plain parameter averaging every ``sync_every`` steps (post-local SGD after ``warmup_steps``).

        Args:
            sync_every: H, optimizer steps between parameter syncs, or ``"auto"``.
            **overrides: any other field of the config, e.g. ``warmup_steps=500``.
        """
        return cls(sync_every=sync_every, **overrides)
