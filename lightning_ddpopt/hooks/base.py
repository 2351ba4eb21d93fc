"""The state every comm hook carries, and the lossy hooks' error feedback with the sync round's one commit rule.

:class:`CommHookState` is what every hook of this package receives as ``state``: the process group, its size, the
ledger it reports to, its host seconds, and what a checkpoint keeps of it. :class:`ErrorFeedbackState` is the state
of the lossy hooks (PowerSGD, int8): per-parameter error feedback that survives AMP and resumes, applied by one rule.

A lossy hook sends an approximation of each gradient and keeps what it lost (the error) to add to the next step's
gradient. Two things keep that state sound under fp16 AMP:

* **Non-finite gradients never enter it.** A sync round (one optimizer step's buckets) stages its new errors in a
  :class:`SyncRound` and commits them only if every all-reduced value the round checked was finite. The test is on
  reduced values, the same on every rank, so every rank takes the same decision.
* **Errors are kept in the units of their loss scale.** Each stored error remembers the loss scale of the backward
  pass that produced it (``CommHookState.loss_scale``) and is rescaled to the current scale before it is added,
  so a GradScaler's growth or backoff does not inject it 2x too large or too small.

Errors are keyed by parameter name (not bucket index), so they survive DDP's bucket rebuild after the first step
and a resume into another bucket layout.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import to_device
from lightning_ddpopt.hooks.streams import SideStreams

if TYPE_CHECKING:
    from lightning_ddpopt.ledger import CommHook, CommLedger
    from lightning_ddpopt.topology import TierGroups

__all__ = [
    "CommHookState",
    "ErrorFeedbackState",
    "MakeTwoTierState",
    "SyncRound",
    "TwoTierForm",
    "add_feedback",
    "config_mismatch",
    "fed_back_sq",
    "squared_norm",
]


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
            work: the collective's handle (typed optional as torch types it; never ``None`` with ``async_op=True``).
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

    def run_beside_backward(
        self, make_group: Callable[[], dist.ProcessGroup], model_group: dist.ProcessGroup | None
    ) -> dist.ProcessGroup | None:
        """On a CPU, take a group of its own for work beside the backward pass; ``None``: the hook runs in its call.

        The strategy calls it once at setup, on every rank, for a registry hook on CPU ranks. A hook whose work runs
        on threads of its own (PowerSGD's chains, int8's point-to-point stages) takes a group there: the backward
        pass may issue collectives on the model's group meanwhile (DDP's unused-parameter map, a loss's
        all_gather), which must not interleave with the hook's. The strategy destroys the group at teardown.

        Args:
            make_group: makes a group over the model's ranks (every rank calls it in one order).
            model_group: DDP's group, for an agreement the hook needs first.
        """
        return None

    def release_group(self) -> None:
        """Drop every reference to the groups it communicates on (after :meth:`close`; the strategy destroys them).

        It falls back to the default group, for a checkpoint saved after fit.
        """
        self.process_group = None

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

    Args:
        tensors: the tensors, on one device.
    """
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for tensor in tensors:
        total += torch.linalg.vector_norm(tensor, dtype=torch.float32).double().square()
    return total


class SyncRound:
    """One sync round's staged state, committed only if all the reduced values it checked were finite.

    ``on_device``: the verdict stays on the device and the commit selects on the device (see
    :meth:`ErrorFeedbackState._commit`); ``None``: so for CUDA flags, on the host for CPU ones.
    """

    def __init__(self, scale: torch.Tensor | None, on_device: bool | None = None) -> None:
        self.scale = scale
        self.errors: dict[str, torch.Tensor] = {}
        self.q_memories: dict[str, torch.Tensor] = {}
        self.sent_exactly: set[str] = set()
        self.buffers: dict[str, torch.Tensor] = {}
        self.on_device = on_device
        self._flags: list[torch.Tensor] = []
        self._finite: torch.Tensor | None = None

    def check(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """Note whether ``tensors`` (all-reduced: the same on every rank) are finite; return that as a 0-dim flag."""
        flag = torch.stack([t.isfinite().all() for t in tensors]).all()
        self._flags.append(flag)
        return flag

    def complete(self) -> bool:
        """End the round; return whether it can be committed at once.

        A verdict on the device (a GPU's, or ``on_device=True`` on a CPU: the GPU path under test) is committed when
        the next round opens or the state is saved, so that the host never waits for it.
        """
        if self._flags:
            device = self._flags[0].device
            finite = torch.stack([flag.to(device) for flag in self._flags]).all()
        else:
            finite = torch.ones((), dtype=torch.bool)
        self._finite = finite
        if self.on_device is None:
            self.on_device = finite.is_cuda
        return not self.on_device

    @property
    def verdict(self) -> torch.Tensor:
        """The completed round's verdict, a 0-dim bool tensor where the flags are (``True``: every value was finite)."""
        assert self._finite is not None, "complete() first"
        return self._finite


@dataclass(kw_only=True)
class ErrorFeedbackState(CommHookState):
    """Step counter, per-parameter errors with their loss scales, and the staged round; see the module doc.

    ``iteration`` advances once per sync round. ``skipped_rounds`` counts rounds whose reduced values were not
    finite and left the state untouched. Call :meth:`bind_module` with the wrapped module before the first step.

    A lossy hook of your own subclasses it with its config (and :meth:`config_dict`), and in each bucket calls
    :meth:`open_round`, :meth:`add_error_feedback`, stages each parameter's new error in ``round_.errors`` (in a
    buffer from :meth:`error_buffer`), checks the reduced values (``round_.check``) and, at the last bucket,
    :meth:`close_round`: see the guide "Writing a comm hook".

    Args:
        process_group: the group the hook communicates on; ``None`` for the default (world) group.
        ledger: where the hook reports its bytes; ``None`` records nothing.
        loss_scale: returns the current loss scale (the strategy sets it); see :class:`CommHookState`.
        iteration: sync rounds so far (restored from a checkpoint; leave it 0).
        skipped_rounds: rounds whose reduced values were not finite and left the state untouched.
        errors: this rank's error feedback per parameter name (saved in checkpoints).
        error_scales: the loss scale each error was computed at.
    """

    #: The hook's name in messages about its saved state.
    label: ClassVar[str] = "hook"

    iteration: int = 0
    skipped_rounds: int = 0
    errors: dict[str, torch.Tensor] = field(default_factory=dict)
    error_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict, repr=False)
    _round: SyncRound | None = field(default=None, repr=False)
    _completed: SyncRound | None = field(default=None, repr=False)
    #: The last closed round, until :meth:`take_verdict` reads its verdict (``None``: taken, or no round checked).
    _verdict_round: SyncRound | None = field(default=None, repr=False)
    _scale_unknown: set[str] = field(default_factory=set, repr=False)
    _backing: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _spare: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    #: Entries a round committed on the device added or dropped, before its verdict reached the host: ``(table,
    #: key)`` -> a 0-dim bool tensor, true where the host's commit holds the entry (read at a save: :meth:`_resolve`).
    _held: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)
    #: Rounds skipped on the device and not yet counted in ``skipped_rounds`` (read at a save).
    _skipped_on_device: torch.Tensor | None = field(default=None, repr=False)
    #: Commit on the device even for CPU flags (tests of the GPU path on a CPU); ``None``: for CUDA flags.
    _verdict_on_device: bool | None = field(default=None, repr=False)
    #: Where the hook's chains run on CUDA; the state above is made and used on those streams.
    _streams: SideStreams = field(default_factory=SideStreams, repr=False)

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names that key the per-parameter state (``module`` is the one DDP wraps)."""
        self._names = {id(param): name for name, param in module.named_parameters() if param.requires_grad}

    def names_in(self, bucket: dist.GradBucket) -> list[str]:
        """The names of the bucket's parameters, in the order of ``bucket.gradients()``.

        Args:
            bucket: the bucket DDP hands the hook.
        """
        if not self._names:
            raise RuntimeError(f"{type(self).__name__}.bind_module(module) must be called before the first step")
        return [self._names[id(param)] for param in bucket.parameters()]

    def config_dict(self) -> dict[str, object]:
        """The hook's config as it is saved and compared (each subclass holds one)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, object]:
        """The config, the step counter, the skipped rounds and the errors with their loss scales (on the CPU)."""
        # Committed where the errors live (the hook's side stream on a GPU), then read after it.
        self._streams.call(self._apply_completed)
        self._streams.join()
        if self._skipped_on_device is not None:
            self.skipped_rounds += int(self._skipped_on_device)
            self._skipped_on_device = None
        self._resolve()
        return {
            "config": self.config_dict(),
            "iteration": self.iteration,
            "skipped_rounds": self.skipped_rounds,
            "errors": {name: error.detach().cpu().clone() for name, error in self.errors.items()},
            "error_scales": {name: float(scale) for name, scale in self.error_scales.items()},
        }

    def mismatch(self, state: dict[str, object]) -> str | None:
        """Name the config fields in which ``state`` differs from this run's, or ``None`` when they agree."""
        return config_mismatch(self.label, state, self.config_dict())

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output; tensors move to the gradients' device on first use.

        Raises:
            ValueError: ``state`` was saved with another config (see :meth:`mismatch`).
        """
        reason = self.mismatch(state)
        if reason is not None:
            raise ValueError(f"cannot load {self.label} state: {reason}")
        self.load_shared_state_dict(state)
        iteration, errors, scales = state["iteration"], state["errors"], state.get("error_scales", {})
        skipped = state.get("skipped_rounds", 0)
        assert isinstance(iteration, int) and isinstance(errors, dict) and isinstance(scales, dict)
        assert isinstance(skipped, int)
        self._drop_errors()
        self.iteration, self.skipped_rounds = iteration, skipped
        self.errors = dict(errors)
        self.error_scales = {name: torch.tensor(scale, dtype=torch.float32) for name, scale in scales.items()}
        # Saved by a release that did not record loss scales: each error is taken to be in the units of the first
        # round that adds it (added as it is), and kept in them (:meth:`stored_error`).
        self._scale_unknown = set() if "error_scales" in state else set(errors)

    def forget_errors(self) -> None:
        """Drop every stored and staged error (a fault-tolerant heal replaced the weights they were computed on)."""
        self._drop_errors()

    def _drop_errors(self) -> None:
        self.errors, self.error_scales, self._scale_unknown = {}, {}, set()
        self._round = self._completed = self._verdict_round = None
        self._backing, self._spare, self._held = {}, {}, {}

    def error_buffer(
        self, round_: SyncRound, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised buffer for this round's errors under ``key`` (the same key covers the same parameters).

        It is the buffer of the round before the last committed one when that fits: the new errors must not
        overwrite the committed ones (a non-finite round keeps them), but a fresh gradient-sized allocation every
        step costs more than the arithmetic (the kernel hands large blocks out zeroed, page by page). So error
        feedback holds two copies of the compressed gradients, one committed and one being written.

        Args:
            round_: this round (:meth:`open_round`).
            key: what the buffer holds errors of (a parameter's name, or several joined), the same every step.
            shape: the buffer's shape.
            dtype: its dtype.
            device: its device.
        """
        buffer = self._spare.pop(key, None)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        round_.buffers[key] = buffer
        return buffer

    def open_round(self) -> SyncRound:
        """This sync round's staged state; a hook calls it in every bucket, and the first one opens the round.

        Opening a round first commits the one before it, if that one's verdict is in. The round's errors
        (``round_.errors``) and its other staged state are committed only if every value that ``round_.check``
        was given is finite.
        """
        if self._round is None:
            self._apply_completed()
            scale = self.loss_scale() if self.loss_scale is not None else None
            scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else None
            self._round = SyncRound(scale, on_device=self._verdict_on_device)
        return self._round

    def close_round(self, seal_now: bool = True) -> None:
        """End the round at its last bucket (``bucket.is_last()``): count it, and commit it if its verdict is in.

        Args:
            seal_now: every bucket's checks are in (the hook finished each bucket before returning its future);
                ``False`` for a hook that finishes buckets in future callbacks: the round is judged when the next
                one opens (DDP has waited for every bucket by then), when the state is saved, or when the strategy
                takes its verdict after backward.
        """
        self.iteration += 1
        round_, self._round = self._round, None
        self._verdict_round = round_
        if round_ is not None:
            self._apply_completed()
            self._completed = round_
            if seal_now and round_.complete():
                self._apply_completed()

    def take_verdict(self) -> torch.Tensor | None:
        """Whether every value the last closed round sent was finite (a 0-dim bool tensor), once; ask after backward.

        The round checked all-reduced values, so the verdict is every rank's alike and covers every rank's gradients
        (a non-finite value on any rank makes what it was reduced into non-finite). ``None`` when the verdict was
        taken already or the round checked nothing (PowerSGD's exact warm-up): a callback then checks for itself.
        Every bucket's checks are in by the time DDP's backward returns, so completing it here changes nothing the
        commit decides.
        """
        round_, self._verdict_round = self._verdict_round, None
        if round_ is None or not round_._flags:
            return None
        if round_._finite is None:
            round_.complete()
        return round_.verdict

    def _apply_completed(self) -> None:
        """Commit the completed round, if any (see :meth:`_commit`)."""
        round_, self._completed = self._completed, None
        if round_ is None:
            return
        if round_._finite is None:
            round_.complete()
        self._commit(round_)

    def _commit(self, round_: SyncRound) -> None:
        """Make the round's state the stored one if every value it checked was finite: one rule, on host and device.

        On the host (a CPU verdict) the verdict is read: a finite round's errors, loss scales and shared state
        replace the stored ones (and errors of tensors it sent exactly are dropped); a non-finite round leaves the
        state untouched and is counted. On the device (a CUDA verdict, never read on the host) the same rule is
        applied by selection: each value the round writes becomes, in place, ``where(finite, new, stored)``, and an
        entry the round adds or drops stays in its table with its presence as a flag on the device (an absent
        error holds zeros, which add nothing). :meth:`_resolve` reads the flags at a save: both paths train on the
        same values and save the same state, bit for bit. Skipped rounds are counted on the device meanwhile.
        """
        finite: torch.Tensor | None = None
        if round_.on_device:
            finite = round_.verdict
            skipped = (~finite).to(torch.int64)
            self._skipped_on_device = skipped if self._skipped_on_device is None else self._skipped_on_device + skipped
        elif not bool(round_.verdict):
            self.skipped_rounds += 1
            self._spare.update(round_.buffers)
            return
        for name, new in round_.errors.items():
            self._put("errors", name, new, finite, torch.zeros_like)
            if round_.scale is not None:
                self._put("scales", name, round_.scale, finite, lambda scale: scale, in_place=False)
            else:
                self._drop("scales", name, finite)
        for name in round_.sent_exactly:  # no compression error: nothing to feed back any more
            self._drop("errors", name, finite)
            self._drop("scales", name, finite)
        self._commit_shared(round_, finite)
        # A key's previous buffer backs no error any more (this round's errors under the key replaced all of them):
        # it is the next round's to write. Keys this round did not use (an earlier bucket layout) are forgotten, so
        # their buffers are freed once no error refers to them.
        previous, self._backing = self._backing, dict(round_.buffers)
        self._spare = {
            key: previous[key] for key in round_.buffers if key in previous and previous[key] is not round_.buffers[key]
        }

    def _commit_shared(self, round_: SyncRound, finite: torch.Tensor | None) -> None:
        """Commit state shared by every rank (PowerSGD's Q memories) by :meth:`_commit`'s rule (``None``: finite)."""

    def _tables(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tables a round commits into, by name (for :meth:`_put`, :meth:`_drop` and :meth:`_resolve`)."""
        return {"errors": self.errors, "scales": self.error_scales}

    def _put(
        self,
        table: str,
        key: str,
        new: torch.Tensor,
        finite: torch.Tensor | None,
        absent: Callable[[torch.Tensor], torch.Tensor],
        in_place: bool = True,
    ) -> None:
        """Store ``new`` under ``key`` in ``table``: if the round was finite (``None``: known to be), else keep.

        On the device ``new`` becomes ``where(finite, new, stored)`` (``absent(new)`` where nothing is stored: a
        value equivalent to no entry), in place unless ``in_place`` is false, and the entry's presence is held.
        """
        store = self._tables()[table]
        if finite is not None:
            old = store.get(key)
            held = self._held.get((table, key))
            known = old is not None and old.shape == new.shape
            kept = old.to(new.device) if known and old is not None else absent(new)
            new = torch.where(finite, new, kept, out=new) if in_place else torch.where(finite, new, kept)
            if not known:
                self._held[(table, key)] = finite
            elif held is not None:
                self._held[(table, key)] = finite | held
        else:
            self._held.pop((table, key), None)
        store[key] = new

    def _drop(self, table: str, key: str, finite: torch.Tensor | None) -> None:
        """Drop ``key``'s entry from ``table`` if the round was finite (``None``: known to be), else keep it.

        On the device an error becomes zeros where the round was finite (a new tensor: the old one may lie in a
        buffer the next round writes) and the entry's presence is held.
        """
        store = self._tables()[table]
        old = store.get(key)
        if old is None:
            return
        if finite is None:
            del store[key]
            self._held.pop((table, key), None)
            return
        if table == "errors":
            store[key] = torch.where(finite, torch.zeros_like(old), old)
        held = self._held.get((table, key))
        self._held[(table, key)] = ~finite if held is None else ~finite & held

    def _resolve(self) -> None:
        """Read the presence of the entries held on the device (one host read) and drop the absent ones."""
        if not self._held:
            return
        held, self._held = self._held, {}
        device = next(iter(held.values())).device
        present = torch.stack([flag.to(device) for flag in held.values()]).tolist()
        tables = self._tables()
        for (table, key), keep in zip(held, present, strict=True):
            if not keep:
                tables[table].pop(key, None)

    def add_error_feedback(
        self, round_: SyncRound, names: list[str], gradients: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """Add each gradient's stored error, rescaled from the loss scale it was stored at to this round's.

        Returns the squared norm of what was added when the round is measured (:attr:`measuring`), else ``None``.

        Args:
            round_: this round (:meth:`open_round`).
            names: the gradients' parameter names (:meth:`names_in`).
            gradients: the gradients, changed in place.
        """
        feedback = [self.stored_error(round_, name, gradient) for name, gradient in zip(names, gradients, strict=True)]
        add_feedback(gradients, feedback)
        return fed_back_sq(feedback) if self.measuring else None

    def stored_error(
        self, round_: SyncRound, name: str, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The error stored under ``name`` shaped like ``target``, and the factor to this round's loss scale.

        The factor is ``None`` where none is needed; the result is ``None`` when no error of ``target``'s size is
        stored. Besides ``target``'s own shape, its matrix shape fits: PowerSGD keeps a conv kernel's error as the
        matrix it compressed.
        """
        error = self.errors.get(name)
        if error is None or error.shape not in (target.shape, target.reshape(target.shape[0], -1).shape):
            return None
        if error.device != target.device:  # restored on the CPU: copied without a host wait
            error = self.errors[name] = to_device(error, target.device)
        error = error.reshape(target.shape)
        if name in self._scale_unknown:
            # Saved without its loss scale: taken to be in this round's units, and kept in them from now on.
            self._scale_unknown.discard(name)
            if round_.scale is not None:
                self.error_scales[name] = round_.scale
            return error, None
        stored = self.error_scales.get(name)
        if stored is None and round_.scale is None:
            return error, None
        current = round_.scale if round_.scale is not None else torch.ones((), device=target.device)
        if stored is not None and stored.device != target.device:
            stored = self.error_scales[name] = to_device(stored, target.device)
        ratio = current / (stored if stored is not None else 1.0)
        return error, ratio.to(target.dtype)


def add_feedback(
    targets: Iterable[torch.Tensor], feedback: Iterable[tuple[torch.Tensor, torch.Tensor | None] | None]
) -> None:
    """Add each stored error in ``feedback`` to its target, in place, at this round's loss scale.

    ``feedback``: :meth:`ErrorFeedbackState.stored_error`'s results, one per target (``None``: nothing stored).
    """
    for target, found in zip(targets, feedback, strict=True):
        if found is None:
            continue
        error, ratio = found
        if ratio is None:
            target.add_(error)
        else:
            target.addcmul_(error, ratio)


def fed_back_sq(feedback: Iterable[tuple[torch.Tensor, torch.Tensor | None] | None]) -> torch.Tensor | None:
    """The squared norm of the stored errors in ``feedback``, each at this round's loss scale; ``None`` for none.

    ``feedback``: :meth:`ErrorFeedbackState.stored_error`'s results.
    """
    total: torch.Tensor | None = None
    for found in feedback:
        if found is None:
            continue
        error, ratio = found
        norm_sq = squared_norm(error)
        if ratio is not None:
            norm_sq = norm_sq * ratio.double().square()
        total = norm_sq if total is None else total + norm_sq
    return total


def config_mismatch(hook: str, state: dict[str, object], config: dict[str, object]) -> str | None:
    """Name the fields in which a saved state's config differs from ``config``, or ``None`` when they agree."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        return f"the saved {hook} state has no config"
    changed = [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in config.items() if saved.get(key) != value]
    return f"the {hook} config changed ({', '.join(changed)})" if changed else None


class MakeTwoTierState(Protocol):
    """What builds a two-tier hook's state, from the flat hook's state (its config) and the tiers' groups."""

    def __call__(
        self,
        *,
        flat: CommHookState,
        tiers: TierGroups,
        process_group: dist.ProcessGroup,
        ledger: CommLedger,
        device: torch.device,
    ) -> CommHookState:
        """The two-tier state; the strategy then sets its ``loss_scale`` and calls its ``bind_module``.

        Args:
            flat: the state the registry entry's ``make_state`` built (its config applies to both forms).
            tiers: the intra- and cross-node groups.
            process_group: DDP's group (every rank).
            ledger: where the hook reports its bytes.
            device: the gradients' device.
        """
        ...


@dataclass(frozen=True)
class TwoTierForm:
    """A registry hook's two-tier form: the hook and state that replace the flat ones on several nodes.

    Attributes:
        hook: the two-tier hook, torch's ``(state, bucket) -> Future[Tensor]`` signature.
        make_state: builds its state (see :class:`MakeTwoTierState`).
        crossing: what crosses the nodes, in words, for the setup log line ("int8 blocks").
        flat_when_auto: why ``hierarchical="auto"`` keeps the flat sync with this hook (``hierarchical=True`` uses
            the form anyway); ``None``: ``"auto"`` uses it.
    """

    hook: CommHook
    make_state: MakeTwoTierState
    crossing: str
    flat_when_auto: str | None = None
