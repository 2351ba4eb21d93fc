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
        islands: how many islands the run has (required): the training data is split into ``islands`` x island ranks
            shards, one per rank of the run, as one DDP job of that many ranks would split it. Each island trains on
            its own shards; a lost island's shards are skipped while it is away.
        island: this island's index, ``0`` to ``islands - 1`` (default: ``REPLICA_GROUP_ID`` from the environment, as
            torchft's launchers set it, else ``replica_id`` where it is a number). Give a restarted island its index
            again: it takes its own shards back.
        lighthouse: the Lighthouse's address, ``"http://host:port"`` (or ``"host:port"``); ``None`` (default):
            the ``TORCHFT_LIGHTHOUSE`` environment variable, as torchft reads it. Start one with
            ``ddpopt lighthouse --min-replicas N``.
        min_replicas: islands that must take part for a step (or a local SGD sync) to commit, at least 1 (an island
            that heals at a quorum takes part from the next). The Lighthouse's ``--min-replicas`` (what a quorum
            waits for) must be at least this: a run whose first quorum has fewer islands stops on every island of it
            with an error naming both counts. Later, a quorum with fewer islands taking part drops its steps, with a
            warning.
        replica_id: this island's name in the quorum (default: ``"island"`` and its index); give a restarted island
            the same name.
        timeout_s: seconds a cross-island collective, a commit vote or a heal's transfer may take before the step
            is dropped.
        quorum_timeout_s: seconds to wait for a quorum of ``min_replicas`` islands before the run fails; ``None``
            (default): 60 s per step, and with local SGD 60 s plus 10 s per step of a sync window (a restarted island
            waits there for the live islands' next sync).
        connect_timeout_s: seconds to reach the Lighthouse and the other islands' managers; an unreachable
            Lighthouse fails setup after this, naming the address.
        compression: the precision each step's gradients cross the islands in: ``"fp32"`` (default), or ``"fp16"``
            or ``"bf16"`` (half the bytes on the link between islands; each island's gradients are divided by the
            islands taking part before the cast, as the ``fp16`` hook does, so the sum overflows only where the mean
            would). Per step only: with ``local_sgd`` the change is compressed by ``LocalSGDConfig(compression=...)``.
    """

    islands: int | None = None
    island: int | None = None
    lighthouse: str | None = None
    min_replicas: int = 1
    replica_id: str | None = None
    timeout_s: float = 60.0
    quorum_timeout_s: float | None = None
    connect_timeout_s: float = 10.0
    compression: Literal["fp32", "fp16", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        if self.lighthouse is not None:
            lighthouse_host_port(self.lighthouse, "FaultTolerance lighthouse")
        if self.islands is not None:
            require_int("FaultTolerance islands", self.islands, 1)
            if self.min_replicas > self.islands:
                raise ValueError(
                    f"FaultTolerance min_replicas={self.min_replicas} is above islands={self.islands}: no step could "
                    "commit; give min_replicas at most the islands the run has"
                )
        if self.island is not None:
            require_int("FaultTolerance island", self.island, 0)
            if self.islands is not None and self.island >= self.islands:
                raise ValueError(
                    f"FaultTolerance island={self.island} must be from 0 to islands - 1 = {self.islands - 1}"
                )
        require_int("FaultTolerance min_replicas", self.min_replicas, 1)
        if self.replica_id is not None and (not isinstance(self.replica_id, str) or not self.replica_id):
            raise ValueError(f"FaultTolerance replica_id={self.replica_id!r} must be a non-empty string or None")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            if getattr(self, name) is not None or name != "quorum_timeout_s":
                require_number(f"FaultTolerance {name}", getattr(self, name))
        if self.compression not in WIRE_DTYPES:
            raise ValueError(
                f"FaultTolerance compression={self.compression!r} must be one of {', '.join(map(repr, WIRE_DTYPES))}"
            )

    def index(self) -> int:
        """This island's index: ``island``, else ``REPLICA_GROUP_ID``, else ``replica_id`` where it is a number.

        Raises:
            ValueError: ``islands`` is not declared, or no index is found, or it is not below ``islands``.
        """
        if self.islands is None:
            raise ValueError(
                "FaultTolerance(islands=None): declare how many islands the run has (islands=N, with this island's "
                "index in island=K or REPLICA_GROUP_ID=K): the strategy splits the training data into one shard per "
                "rank of all the islands, and without the count every island would train on the same samples"
            )
        where, given, environ = "island", self.island, os.environ.get("REPLICA_GROUP_ID")
        if given is None and environ is not None:
            if not environ.isdigit():
                raise ValueError(
                    f"REPLICA_GROUP_ID={environ!r} is not an island index: set it to this island's index, 0 to "
                    f"{self.islands - 1}, or give FaultTolerance(island=K)"
                )
            where, given = "REPLICA_GROUP_ID", int(environ)
        elif given is None and self.replica_id is not None and self.replica_id.isdigit():
            where, given = "replica_id", int(self.replica_id)
        if given is None:
            raise ValueError(
                f"FaultTolerance(islands={self.islands}) needs this island's index: give island=K (0 to "
                f"{self.islands - 1}) or set REPLICA_GROUP_ID=K in the island's environment"
            )
        if not 0 <= given < self.islands:
            raise ValueError(
                f"{'FaultTolerance island' if where == 'island' else where}={given} must be from 0 to islands - 1 = "
                f"{self.islands - 1}"
            )
        return given

    def name(self) -> str:
        """This island's name in the quorum: ``replica_id``, else ``"island"`` and its index."""
        return self.replica_id or f"island{self.index()}"

    def sampler_kwargs(self, island_size: int, island_rank: int) -> dict[str, int]:
        """The training sampler's shard of the whole run: ``islands x island_size`` shards, this rank's one.

        As one DDP job of all the islands' ranks would split the data (torchft's own sampler does the same).

        Args:
            island_size: the ranks of each island (the island job's world size).
            island_rank: this rank's place in its island.
        """
        index = self.index()
        assert self.islands is not None
        return {"num_replicas": self.islands * island_size, "rank": index * island_size + island_rank}

    def quorum_timeout(self, sync_every: int) -> float:
        """Seconds to wait for a quorum: the argument, else 60 s plus 10 s per step of a local SGD sync window.

        Args:
            sync_every: steps between the islands' meetings (local SGD's ``sync_every``; 1 per step).
        """
        if self.quorum_timeout_s is not None:
            return self.quorum_timeout_s
        return 60.0 + (10.0 * sync_every if sync_every > 1 else 0.0)

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
    config.index()  # the islands declared and this one's index found, or the error saying what to give
    if local_sgd is not None and config.compression != "fp32":
        raise ValueError(
            f"FaultTolerance compression={config.compression!r} is for the per-step average across islands; with "
            "local_sgd the change is compressed by LocalSGDConfig(compression=...): leave FaultTolerance's at 'fp32'"
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
        if local_sgd.sync_every == "auto":
            raise ValueError(
                "local_sgd sync_every='auto' is not supported with fault_tolerance yet (give a number of steps): the "
                "islands join and leave the quorum, and a returning island could not agree with the others on H"
            )
        if local_sgd.compression == "int8":
            raise ValueError(
                "local_sgd compression='int8' is not supported with fault_tolerance: torchft's fault-tolerant "
                "collective is an all-reduce, which cannot sum int8 values in int8 (the int8 mean needs an all-gather);"
                " choose 'fp16' or 'bf16' (half the bytes of 'fp32')"
            )
    require_torchft()
