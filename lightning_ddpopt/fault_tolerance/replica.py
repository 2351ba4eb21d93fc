"""This island as one replica group of torchft's quorum: the step's quorum, the cross-island average, the commit.

Each optimizer step of a fault-tolerant run goes:

1. :meth:`Replica.start_step` before the step's first forward: torchft computes the quorum of live islands in the
   background (a returning island learns there that it must heal, and from whom).
2. The island's backward syncs its gradients inside the island, through DDP and the strategy's hook, as always;
   as each bucket's sync ends, :func:`~lightning_ddpopt.hooks.across_islands.across_islands_hook` averages it across
   the islands of the quorum while the backward pass goes on (:meth:`Replica.average_chunk`: each rank of the island
   its 1/M, through torchft's fault-tolerant process group, in ``compression``; the island gathers the averages),
   over the islands that take part (a healing island takes part with zeros).
3. (:meth:`Replica.average_gradients`: the same after the backward pass, where no hook averaged them.)
4. :meth:`Replica.commit`: every island votes; the step commits only where every island of the quorum succeeded.
   A failed collective (an island lost mid-step) drops the step on every island, which then train on without it.

A healing island receives a peer's whole training state at its commit (:mod:`lightning_ddpopt.fault_tolerance.state`),
then takes the committed step with the others: its parameters equal theirs from there on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lightning_ddpopt._compat import quiet_access_log
from lightning_ddpopt.fault_tolerance.config import FaultTolerance, require_torchft
from lightning_ddpopt.fault_tolerance.lighthouse import check_reachable
from lightning_ddpopt.hooks.across_islands import parameter_chunks
from lightning_ddpopt.localsgd.config import WIRE_DTYPES

__all__ = ["CHUNK_VALUES", "NCCL_FLOOR", "Replica", "ReplicaStats", "check_nccl", "check_store_address"]

#: Values of a chunk of the per-step average across islands (4 MiB of fp32): its memory, and its messages' size.
CHUNK_VALUES = 1 << 20
#: The NCCL release torchft needs to abort a failed collective (NCCL's communicator shrink and abort).
NCCL_FLOOR = (2, 25)


@dataclass
class ReplicaStats:
    """What the quorum did to this island so far (for the logs, the report and tests)."""

    #: This island's name in the quorum (without torchft's per-start suffix).
    replica_id: str = ""
    #: The run's committed steps as of this island's last commit (torchft's step: a heal brings the peer's).
    step: int = 0
    #: Steps this island committed, and dropped, itself.
    committed: int = 0
    dropped: int = 0
    heals: int = 0
    heal_seconds: float = 0.0
    quorum_changes: int = 0
    participants: int = 0
    #: ``(step, participants)`` at each change of the quorum's size (the step counts the run's committed steps).
    history: list[tuple[int, int]] = field(default_factory=list)
    #: The averages across the islands this island ran (steps or local SGD syncs), the bytes this rank sent into
    #: them, and their seconds (the step waits for all of it: it comes after the backward pass).
    averages: int = 0
    average_bytes: int = 0
    average_seconds: float = 0.0
    #: Seconds from this island's first quorum to its last vote (the time its steps took, averages included).
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        """What the strategies log each step, under ``ddpopt/ft/``."""
        return {
            "ddpopt/ft/participants": float(self.participants),
            "ddpopt/ft/dropped_steps": float(self.dropped),
            "ddpopt/ft/heals": float(self.heals),
        }


class Replica:
    """This island's torchft manager, with the Lightning state a returning island heals from.

    Args:
        config: the user's :class:`~lightning_ddpopt.fault_tolerance.FaultTolerance`.
        island_rank: this rank's place in its island (torchft's group rank).
        island_size: the island's ranks (torchft's group world size).
        store: ``(host, port)`` of the island's TCPStore (the one its process group was set up with).
        state_dict: returns the island's whole training state, for a peer that heals.
        load_state_dict: loads such a state into this island when it heals.
        device: the device the gradients are on (gloo for a CPU, NCCL for CUDA).
        sync_every: steps between the islands' meetings (local SGD's window; 1 per step), for the quorum's timeout.
    """

    #: When this island asked for its first quorum (``perf_counter``), for :attr:`ReplicaStats.seconds`.
    _started: float | None = None

    def __init__(
        self,
        config: FaultTolerance,
        island_rank: int,
        island_size: int,
        store: tuple[str, int],
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        device: torch.device,
        sync_every: int = 1,
    ) -> None:
        require_torchft()
        # torchft's Rust side logs every quorum and commit at INFO; a user's RUST_LOG still decides.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        address = config.address()
        check_store_address(store[0], address)
        if device.type == "cuda":
            check_nccl()
        if island_rank == 0:
            check_reachable(address, config.connect_timeout_s)
        self.stats = ReplicaStats()
        self._island_rank, self._island_size = island_rank, island_size
        self._address, self._min_replicas = address, config.min_replicas
        self._quorum_timeout_s = config.quorum_timeout(sync_every)
        self._load = load_state_dict
        self._wire = WIRE_DTYPES[config.compression]
        timeout = timedelta(seconds=config.timeout_s)
        group = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        quiet_torchft()
        self.replica_id = config.name()
        self.stats.replica_id = self.replica_id
        advertised = _advertised(store[0])
        self.manager = Manager(
            pg=group,
            load_state_dict=self._healed,
            state_dict=state_dict,
            min_replica_size=config.min_replicas,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self._quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s),
            rank=island_rank,
            world_size=island_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=address,
            replica_id=self.replica_id,
            hostname=advertised,
            checkpoint_transport=_checkpoint_server(advertised, timeout),
        )
        self._open = False

    @property
    def step_open(self) -> bool:
        """Whether :meth:`start_step` ran and the step has not been committed or dropped yet."""
        return self._open

    def start_step(self) -> None:
        """Ask for this step's quorum (in the background: the forward runs meanwhile)."""
        if self._started is None:
            self._started = time.perf_counter()
        self.manager.start_quorum()
        self._open = True

    def sync_mean(self, change: torch.Tensor, wire: torch.Tensor | None = None) -> bool:
        """Local SGD's sync across islands: a quorum, ``change`` (fp32) averaged over its islands in place, the vote.

        ``wire``: a buffer of ``change``'s size in fp16 or bf16 to send it in (``None``: fp32). Returns whether the
        sync commits; a healing island's own change counts as zeros, and it receives the live islands' state at the
        vote, before the outer step.
        """
        self.start_step()
        self._note_participants()
        self._mean(change, wire)
        self.stats.averages += 1
        return self.commit()

    def _mean(self, flat: torch.Tensor, wire: torch.Tensor | None) -> None:
        """``flat`` (fp32) averaged over the islands taking part, in place.

        torchft's average in fp32; in ``wire``'s fp16 or bf16 divided by the islands first, then cast and summed (the
        fp16 hook's way: the sum overflows only where the mean would).
        """
        started = time.perf_counter()
        if wire is None:
            self.manager.allreduce(flat).wait()
        else:
            wire.copy_(flat.div_(max(self.stats.participants, 1)))
            self.manager.allreduce(wire, reduce_op=ReduceOp.SUM).wait()
            flat.copy_(wire)
        sent = wire if wire is not None else flat
        self.stats.average_bytes += sent.numel() * sent.element_size()
        self.stats.average_seconds += time.perf_counter() - started

    def _note_participants(self) -> None:
        try:
            participants = self.manager.num_participants()
        except TimeoutError as error:
            raise TimeoutError(
                f"no quorum of min_replicas={self._min_replicas} islands formed within quorum_timeout_s="
                f"{self._quorum_timeout_s:g} at the Lighthouse {self._address}: are that many islands started, and was "
                "the Lighthouse started with --min-replicas at most that? (With local SGD an island waits here for the "
                "others' next sync: give quorum_timeout_s more than a sync window's time.)"
            ) from error
        if participants != self.stats.participants:
            self.stats.quorum_changes += self.stats.participants != 0
            self.stats.participants = participants
            self.stats.history.append((self.manager.current_step() + 1, participants))

    def begin_average(self) -> None:
        """Before a step's average across the islands: the quorum's participants (it waits for the quorum)."""
        self._note_participants()
        self.stats.averages += 1

    def average_chunk(self, flat: torch.Tensor, island: dist.ProcessGroup | None) -> None:
        """Average ``flat`` (fp32, the same on the island's ranks) over the islands of the quorum, in place.

        With an ``island`` group of M ranks each rank sends its 1/M across (rank r of every island meets rank r of
        the others) and the island gathers the averaged shards on it: P values leave the island, not M x P.
        """
        size = flat.numel()
        if island is None or self._island_size == 1:
            self._mean(flat, self._wire_buffer(flat))
            return
        per_rank = -(-size // self._island_size)
        padded = flat.new_zeros(per_rank * self._island_size)
        padded[:size] = flat
        shard = padded[self._island_rank * per_rank : (self._island_rank + 1) * per_rank].clone()
        self._mean(shard, self._wire_buffer(shard))
        _all_gather_single(padded, shard, group=island)
        flat.copy_(padded[:size])

    def _wire_buffer(self, values: torch.Tensor) -> torch.Tensor | None:
        """A buffer of ``values``' size in the fp16 or bf16 ``compression`` (``None``: fp32, sent as it is)."""
        return None if self._wire == torch.float32 else torch.empty_like(values, dtype=self._wire)

    def average_gradients(self, parameters: list[torch.nn.Parameter], island: dist.ProcessGroup | None) -> None:
        """After the backward pass: ``parameters``' gradients averaged over the islands, in place.

        See :meth:`average_chunk`; in chunks of consecutive parameters of at most :data:`CHUNK_VALUES` values. Where
        the strategy's hook did not average them during the backward pass (its
        :class:`~lightning_ddpopt.hooks.across_islands.AcrossIslands` ran no step since the last vote).
        """
        self.begin_average()
        for chunk in parameter_chunks(parameters, CHUNK_VALUES):
            # In one order on every island, a missing gradient as zeros: the same shape everywhere, whichever
            # parameters this island's batch used.
            grads = [p.grad if p.grad is not None else p.new_zeros(p.shape) for p in chunk]
            flat = torch.cat([grad.reshape(-1).to(torch.float32) for grad in grads])
            self.average_chunk(flat, island)
            for p, averaged in zip(chunk, flat.split([p.numel() for p in chunk]), strict=True):
                if p.grad is None:
                    p.grad = averaged.view_as(p).to(p.dtype).clone()
                else:
                    p.grad.copy_(averaged.view_as(p))

    def commit(self) -> bool:
        """Vote on the step with every island; ``True``: step the optimizer, ``False``: the step is dropped."""
        committed = bool(self.manager.should_commit())
        self._open = False
        if self._started is not None:
            self.stats.seconds = time.perf_counter() - self._started
        self.stats.step = self.manager.current_step()
        if committed:
            self.stats.committed += 1
            return True
        self.stats.dropped += 1
        participants = self.stats.participants
        if participants < self._min_replicas and self.stats.step == 0 and self.manager.errored() is None:
            # The run's first quorum (a heal that failed leaves its island at step 0 too: errored): every island in
            # it was at step 0 and took part (later, healing islands do not count, and a quorum can legitimately
            # have fewer). A Lighthouse forms no quorum below its own --min-replicas: this one was started with fewer
            # than the islands ask for, and every step would be dropped. Raised after the step's collective, which
            # every island of the quorum reached with its heal done (none stops while another fetches from it).
            raise ValueError(
                f"FaultTolerance(min_replicas={self._min_replicas}) is above the quorum the Lighthouse at "
                f"{self._address} formed, of {participants} island(s): its --min-replicas is lower, and every step "
                f"would be dropped. Start the Lighthouse with --min-replicas {self._min_replicas}, or give "
                "min_replicas at most the Lighthouse's"
            )
        if self._island_rank == 0:
            error = self.manager.errored()
            cause = getattr(error, "original_exception", error)
            said = f": {str(cause).splitlines()[0]}" if cause is not None and str(cause) else ""
            why = (
                f"the quorum has {participants} island(s) taking part (the others heal first), fewer than "
                f"FaultTolerance(min_replicas={self._min_replicas})"
                if participants < self._min_replicas
                else "a collective failed (an island lost mid-step, or FaultTolerance timeout_s too short for the link)"
                + said
            )
            warnings.warn(
                f"ddpopt: island {self.replica_id} dropped its commit after commit {self.stats.step}: {why}",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

    def _healed(self, state: dict[str, Any]) -> None:
        """Load the state torchft hands over at the commit (a peer's, fetched during the quorum), timed."""
        started = time.perf_counter()
        self._load(state)
        self.stats.heals += 1
        self.stats.heal_seconds += time.perf_counter() - started

    def close(self) -> None:
        """Leave the quorum (at the end of fit)."""
        self.manager.shutdown(wait=False)


def quiet_torchft() -> None:
    """Keep torchft's own logging below what a user sees, unless they set its loggers' levels.

    Its quorum and commit records, a lost island's traceback, CPU-only notes: the strategy says what a fault did, in
    one line. Also the warning that torch's deserialization prints for each healed state (a read-only buffer it
    copies from).
    """
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:  # nobody asked for it
            logger.setLevel(logging.CRITICAL)
    warnings.filterwarnings(
        "ignore",
        message="The given buffer is not writable",
        category=UserWarning,
        module="torch.distributed._serialization",
    )


def _checkpoint_server(host: str, timeout: timedelta) -> Any:
    """The HTTP checkpoint server of torchft (a healing peer fetches this island's state there), advertised at ``host``.

    torchft's own advertises the machine's name, which peers may not resolve to this island (a host with several
    interfaces, a container): the manager's address (see :func:`_advertised`) is the one the other islands reach.
    """
    from torchft.checkpointing import HTTPTransport

    class _Advertised(HTTPTransport):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            quiet_access_log(self)  # no access-log line per heal's fetch

        def address(self) -> str:
            parts = urlsplit(super().address())
            name = f"[{host}]" if ":" in host and not host.startswith("[") else host
            return urlunsplit((parts.scheme, f"{name}:{parts.port}", parts.path, parts.query, parts.fragment))

    return _Advertised(timeout=timeout, num_chunks=0)


#: The island's gather into one tensor (``all_gather_into_tensor`` before torch named it ``all_gather_single``).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _is_loopback(host: str) -> bool:
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:  # a host name
        return False


def _is_this_host(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback address, or one this machine can bind a socket to."""
    bare = host.strip("[]")
    if _is_loopback(bare):
        return True
    try:
        infos = socket.getaddrinfo(bare, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False  # unresolved here: not this machine's name
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))  # only this machine's own addresses can be bound
            return True
        except OSError:
            continue
    return False


def check_store_address(store_host: str, lighthouse: str) -> None:
    """Refuse a loopback store address (``MASTER_ADDR``) where the Lighthouse is on another host.

    torchft advertises an island's store to the other islands of a quorum, which rendezvous there for the
    cross-island group: islands on other hosts would find their own loopback. (A Lighthouse on this machine: the
    islands may all be here, and a loopback store is theirs.)
    """
    host = urlsplit(lighthouse).hostname or ""
    if _is_loopback(store_host) and not _is_this_host(host):
        raise ValueError(
            f"MASTER_ADDR={store_host} is this host's loopback address, and torchft gives the islands of a quorum "
            f"this island's store address to meet at; the Lighthouse at {lighthouse} is on another host, so islands "
            "there would reach their own loopback. Set MASTER_ADDR to an address of this host that the other islands "
            "reach (and MASTER_PORT to a free port)"
        )


def check_nccl() -> None:
    """Refuse an NCCL older than 2.25 on CUDA: torchft aborts a failed collective through NCCL's abort there."""
    version = tuple(torch.cuda.nccl.version())
    if tuple(version[:2]) < NCCL_FLOOR:
        raise RuntimeError(
            f"fault tolerance on CUDA needs NCCL >= {NCCL_FLOOR[0]}.{NCCL_FLOOR[1]} (torchft aborts a collective "
            f"that an island's loss left hanging through it); this torch has NCCL {'.'.join(map(str, version))}: "
            "install a torch built with a newer NCCL"
        )


def _advertised(store_host: str) -> str:
    """The address the other islands reach this island's manager at.

    Its store's host (an IPv6 address in brackets, as a URL needs it), unless that is a loopback address (a job on
    one machine, launched without ``MASTER_ADDR``): then the machine's name, torchft's default.
    """
    if _is_loopback(store_host):
        return socket.gethostname()
    bare = store_host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:  # a host name
        return store_host
    return f"[{bare}]" if address.version == 6 else bare
