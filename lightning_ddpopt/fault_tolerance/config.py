"""What fault tolerance asks of the user: :class:`FaultTolerance`, checked at construction, and torchft's presence.

The arguments name the Lighthouse (torchft's quorum server) and how many islands must take part for a step to
commit; everything else has torchft's meaning. See :mod:`lightning_ddpopt.fault_tolerance` for the method.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_ddpopt._validate import require_int, require_number
from lightning_ddpopt.localsgd.config import WIRE_DTYPES, LocalSGDConfig

__all__ = ["FaultTolerance", "check_fault_tolerance", "lighthouse_host_port", "require_torchft"]

#: The torch release torchft's wheels need (its own floor); the rest of the package keeps torch 2.4.
TORCHFT_TORCH_FLOOR = (2, 7)
_INSTALL = "pip install 'lightning-ddpopt[ft]'"
_ADDRESS = re.compile(r"^(?:(?P<scheme>[a-z]+)://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})/?$")


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """Fault-tolerant replicas on torchft: each island a replica group that can be lost and heal back in.

    Args:
        lighthouse: the Lighthouse's address, ``"http://host:port"`` (or ``"host:port"``); ``None`` (default):
            the ``TORCHFT_LIGHTHOUSE`` environment variable, as torchft reads it. Start one with
            ``ddpopt lighthouse --min-replicas N``.
        min_replicas: islands that must take part for a step (or a local SGD sync) to commit, at least 1 (an island
            that heals at a quorum takes part from the next). The Lighthouse's ``--min-replicas`` (what a quorum
            waits for) must be at least this: a run whose first quorum has fewer islands stops on every island of it
            with an error naming both counts. Later, a quorum with fewer islands taking part drops its steps, with a
            warning.
        replica_id: this island's name in the quorum (default: ``REPLICA_GROUP_ID`` from the environment, else
            the host name and ``MASTER_PORT``); give a restarted island the same name.
        timeout_s: seconds a cross-island collective, a commit vote or a heal's transfer may take before the step
            is dropped.
        quorum_timeout_s: seconds to wait for a quorum of ``min_replicas`` islands before the run fails. With
            local SGD a restarted island waits for the live islands' next sync: give it more than a sync window.
        connect_timeout_s: seconds to reach the Lighthouse and the other islands' managers; an unreachable
            Lighthouse fails setup after this, naming the address.
        compression: the precision each step's gradients cross the islands in: ``"fp32"`` (default), or ``"fp16"``
            or ``"bf16"`` (half the bytes on the link between islands; each island's gradients are divided by the
            islands taking part before the cast, as the ``fp16`` hook does, so the sum overflows only where the mean
            would). Per step only: with ``local_sgd`` the change travels in ``LocalSGDConfig(compression=...)``.
    """

    lighthouse: str | None = None
    min_replicas: int = 1
    replica_id: str | None = None
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    compression: Literal["fp32", "fp16", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        if self.lighthouse is not None:
            lighthouse_host_port(self.lighthouse, "FaultTolerance lighthouse")
        require_int("FaultTolerance min_replicas", self.min_replicas, 1)
        if self.replica_id is not None and (not isinstance(self.replica_id, str) or not self.replica_id):
            raise ValueError(f"FaultTolerance replica_id={self.replica_id!r} must be a non-empty string or None")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            require_number(f"FaultTolerance {name}", getattr(self, name))
        if self.compression not in WIRE_DTYPES:
            raise ValueError(
                f"FaultTolerance compression={self.compression!r} must be one of {', '.join(map(repr, WIRE_DTYPES))}"
            )

    def address(self) -> str:
        """The Lighthouse's address as torchft takes it (``http://host:port``), from the argument or environment."""
        given = self.lighthouse if self.lighthouse is not None else os.environ.get("TORCHFT_LIGHTHOUSE")
        if not given:
            raise ValueError(
                "FaultTolerance(lighthouse=None) needs the TORCHFT_LIGHTHOUSE environment variable (http://host:port);"
                " start a Lighthouse with `ddpopt lighthouse --min-replicas N` and pass its address"
            )
        host, port = lighthouse_host_port(given, "TORCHFT_LIGHTHOUSE" if self.lighthouse is None else "lighthouse")
        return f"http://{host}:{port}"


def lighthouse_host_port(address: str, name: str) -> tuple[str, int]:
    """``address``'s host and port (``http://host:port`` or ``host:port``), else a ``ValueError`` naming ``name``."""
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None or match["scheme"] not in (None, "http") or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{name}={address!r} is not a Lighthouse address: give 'http://host:port' or 'host:port'")
    return match["host"], int(match["port"])


def require_torchft() -> None:
    """Raise ``ImportError`` saying what to install where torchft (or the torch it needs) is missing."""
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if version < TORCHFT_TORCH_FLOOR:
        floor = ".".join(map(str, TORCHFT_TORCH_FLOOR))
        raise ImportError(
            f"fault tolerance runs on torchft, which needs torch >= {floor} (this is torch {torch.__version__}): "
            f"upgrade torch, then {_INSTALL}"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(f"fault tolerance runs on torchft, which is not installed: {_INSTALL}")


def check_fault_tolerance(config: object, local_sgd: LocalSGDConfig | None) -> None:
    """The strategies' check of their ``fault_tolerance`` argument, at construction."""
    if config is None:
        return
    if not isinstance(config, FaultTolerance):
        raise TypeError(f"fault_tolerance={config!r} must be a FaultTolerance(...) or None")
    if local_sgd is not None and config.compression != "fp32":
        raise ValueError(
            f"FaultTolerance compression={config.compression!r} is for the per-step average across islands; with "
            "local_sgd the change travels in LocalSGDConfig(compression=...): leave FaultTolerance's at 'fp32'"
        )
    if local_sgd is not None:
        # The islands sync every H steps through torchft, blocking, the change sent whole in its own precision.
        for name, value, allowed in (
            ("overlap_steps", local_sgd.overlap_steps, 0),
            ("warmup_steps", local_sgd.warmup_steps, 0),
            ("replica", local_sgd.replica, "auto"),
        ):
            if value != allowed:
                raise ValueError(
                    f"local_sgd {name}={value!r} is not supported with fault_tolerance yet (use {allowed!r}): each "
                    "fault-tolerant island is one job, and the islands sync every sync_every steps, blocking"
                )
        if local_sgd.compression == "int8":
            raise ValueError(
                "local_sgd compression='int8' is not supported with fault_tolerance: torchft's fault-tolerant "
                "collective is an all-reduce, which cannot sum int8 values in int8 (the int8 mean needs an all-gather);"
                " choose 'fp16' or 'bf16' (half the bytes of 'fp32')"
            )
    require_torchft()
