"""State shared by the package's comm hooks: the process group, its size, and the ledger they report to."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_ddpopt.ledger import CommLedger

__all__ = ["CommHookState", "squared_norm"]


@dataclass(kw_only=True)
class CommHookState:
    """State every hook of this package receives as ``state``.

    Args:
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        ledger: where the hook reports the bytes it sends; ``None`` records nothing.
        loss_scale: returns the loss scale the current backward pass runs with (a GradScaler's, as a tensor on
            the device, so reading it never syncs the host), or ``None`` without one. Hooks that keep
            gradient-valued state across steps use it to keep that state in the right units; the strategy sets it.

    Hooks that wait for collectives (PowerSGD, int8) do it through :meth:`wait`, which adds up the host seconds
    spent waiting in :attr:`wait_seconds`; :attr:`hook_seconds` adds up the host seconds inside those hooks
    altogether, on whichever thread runs them (:meth:`add_seconds`), so ``hook_seconds - wait_seconds`` is their
    own work (on a GPU: its launch; the waits there only order the stream).
    """

    process_group: dist.ProcessGroup | None = None
    ledger: CommLedger | None = None
    loss_scale: Callable[[], torch.Tensor | None] | None = None
    world_size: int = field(init=False)
    hook_seconds: float = field(default=0.0, init=False, repr=False)
    wait_seconds: float = field(default=0.0, init=False, repr=False)
    _seconds_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.world_size = dist.get_world_size(self.process_group)

    def record_wire_bytes(self, bucket: dist.GradBucket, nbytes: int, intra_node: bool = False) -> None:
        """Tell the ledger how many bytes this rank sent for ``bucket``.

        Args:
            bucket: the bucket the hook handles.
            nbytes: the bytes this rank put into collectives for it.
            intra_node: they went to the ranks of this rank's node only (a hierarchical hook's inner tier).
        """
        if self.ledger is not None:
            self.ledger.add_wire_bytes(bucket.index(), nbytes, intra_node=intra_node)

    def record_tier_seconds(self, bucket_index: int, seconds: float, intra_node: bool) -> None:
        """Tell the ledger the host seconds a hierarchical hook's stage spent on a bucket.

        Args:
            bucket_index: the bucket's index.
            seconds: the stage's host seconds.
            intra_node: a stage inside the node; else the one between the nodes.
        """
        if self.ledger is not None:
            self.ledger.add_tier_seconds(bucket_index, seconds, intra_node)

    @property
    def measuring(self) -> bool:
        """Whether this sync round's compression error is measured (the ledger samples rounds: ``error_every``)."""
        return self.ledger is not None and self.ledger.measuring

    def record_compression(
        self,
        bucket: dist.GradBucket,
        given_sq: torch.Tensor,
        dropped_sq: torch.Tensor,
        fed_back_sq: torch.Tensor | None = None,
    ) -> None:
        """Tell the ledger the squared norms of what ``bucket``'s compression was given and what it dropped.

        Args:
            bucket: the bucket the hook handles.
            given_sq: the squared norm of what was compressed (0-dim tensor).
            dropped_sq: the squared norm of what the compression dropped.
            fed_back_sq: the squared norm of the stored error added to the gradient first (``None``: no error
                feedback).
        """
        if self.ledger is not None:
            if fed_back_sq is None:
                fed_back_sq = torch.zeros((), dtype=given_sq.dtype, device=given_sq.device)
            self.ledger.add_compression(bucket.index(), given_sq, dropped_sq, fed_back_sq)

    def wait(self, work: dist.Work | None) -> None:
        """Wait for ``work`` (a collective issued with ``async_op=True``), adding the time to :attr:`wait_seconds`.

        Args:
            work: the collective's handle; ``None`` waits for nothing.
        """
        assert work is not None
        start = time.perf_counter()
        work.wait()
        self.add_seconds(0.0, waiting=time.perf_counter() - start)

    def add_seconds(self, inside: float, waiting: float = 0.0) -> None:
        """Add to :attr:`hook_seconds` and :attr:`wait_seconds` (hooks may run parts on several threads).

        Args:
            inside: seconds spent inside the hook.
            waiting: of those, seconds spent waiting for collectives.
        """
        with self._seconds_lock:
            self.hook_seconds += inside
            self.wait_seconds += waiting

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn about the module DDP wraps (its parameter names); stateless hooks need nothing.

        Args:
            module: the module DDP wraps.
        """

    def close(self) -> bool:
        """Release what the hook runs beside training (PowerSGD's worker thread); False if it could not yet."""
        return True

    def state_dict(self) -> dict[str, object]:
        """Everything that must survive a checkpoint (nothing, for stateless hooks)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output.

        Args:
            state: what :meth:`state_dict` returned on this rank.
        """

    def mismatch(self, state: dict[str, object]) -> str | None:
        """Why ``state`` (saved by :meth:`state_dict`) cannot be loaded into this hook, or ``None`` if it can.

        Args:
            state: what :meth:`state_dict` returned.
        """
        return None

    def load_shared_state_dict(self, state: dict[str, object]) -> str:
        """Restore only the part of another world size's :meth:`state_dict` that is the same on every rank.

        Returns what was kept, in words, for the warning the user sees.

        Args:
            state: what :meth:`state_dict` returned on a rank of the other world size.
        """
        return "nothing is kept"


def squared_norm(*tensors: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``tensors`` together, a 0-dim float64 tensor on their device (for the ledger's errors).

    Each norm is taken in float32 (as fast as the data is read) and squared in float64, so a large bucket's sum of
    squares keeps its precision.
    """
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for tensor in tensors:
        total += torch.linalg.vector_norm(tensor, dtype=torch.float32).double().square()
    return total
