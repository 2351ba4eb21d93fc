"""State shared by the package's comm hooks: the process group, its size, and the ledger they report to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_ddpopt.ledger import CommLedger

__all__ = ["CommHookState"]


@dataclass(kw_only=True)
class CommHookState:
    """State every hook of this package receives as ``state``.

    Args:
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        ledger: where the hook reports the bytes it sends; ``None`` records nothing.
    """

    process_group: dist.ProcessGroup | None = None
    ledger: CommLedger | None = None
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.world_size = dist.get_world_size(self.process_group)

    def record_wire_bytes(self, bucket: dist.GradBucket, nbytes: int) -> None:
        """Tell the ledger how many bytes this rank sent for ``bucket``."""
        if self.ledger is not None:
            self.ledger.add_wire_bytes(bucket.index(), nbytes)

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn about the module DDP wraps (its parameter names); stateless hooks need nothing."""

    def state_dict(self) -> dict[str, object]:
        """Everything that must survive a checkpoint (nothing, for stateless hooks)."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""
