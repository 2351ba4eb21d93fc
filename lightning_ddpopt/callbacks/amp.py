"""AMPMonitor: loss scale, overflows, skipped steps and non-finite gradients inside Lightning's Trainer.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ddpopt._compat import found_inf_per_device
from lightning_ddpopt._validate import require_int, require_number
from lightning_ddpopt.callbacks._report import report_if_last
from lightning_ddpopt.callbacks._tensorboard import charts, write_layout_if_first
from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.measuring import MeasuringCallback
from lightning_ddpopt.meetings import (
    Exchange,
    gradients_identical,
    gradients_synchronised,
    hook_found_finite,
    meets_in_passing,
    next_step_meets,
)
from lightning_ddpopt.precision import bf16_supported

__all__ = ["AMPMonitor"]

OnNonFinite = Literal["warn", "stop", "raise"]
_ON_NONFINITE = ("warn", "stop", "raise")


class AMPMonitor(MeasuringCallback):
    """Makes the GradScaler's behaviour and non-finite gradients visible.

    With fp16 and a GradScaler (e.g. :func:`lightning_ddpopt.precision.fp16_mixed_precision`), every optimizer step
    is classified exactly: the scaler skips it when its unscaled gradients hold inf/NaN (an *overflow*, followed
    by a scale backoff). These are AMP's expected overflows, counted, not reported as failures. Without a scaler
    (bf16, fp32) a cheap check - one sum per gradient on the device - finds non-finite gradients and names the
    offending parameters; every rank takes the same decision, so ``on_nonfinite="stop"`` or ``"raise"`` cannot
    deadlock the others. With :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s own hooks every rank holds the same
    synchronised gradients, so each decides alike with no collective
    (:func:`~lightning_ddpopt.meetings.gradients_identical`); otherwise one flag per step is exchanged with the
    gradient sync's ranks. A gradient whose finite values sum beyond float32's range (3.4e38) counts as non-finite.
    Under local SGD, whose ranks train apart between syncs, the check runs only where they meet
    (:func:`lightning_ddpopt.meetings.ranks_meet`): at each parameter sync (and the end of fit), on the gradients and
    the parameters, which a non-finite gradient leaves non-finite after the optimizer step (gradient clipping by
    value turns an infinite gradient finite before the step, and a NaN stays); a finding then covers the steps since
    the previous sync and counts as one in ``nonfinite_steps``. With ``overlap_steps`` the ranks do not wait for
    each other at a sync's start, so the verdicts exchanged there are acted on at the next sync's start (or the end
    of fit), one window later. On a GPU the check never synchronises the host: a step's verdict is copied without
    blocking and read at the next step's check, so a finding, ``"stop"`` and ``"raise"`` come one step later.

    Logged at every optimizer step (``on_step``), through the Trainer's loggers:

    ================================  ==================================================================  ===========
    key                               meaning                                                             when
    ================================  ==================================================================  ===========
    ``ddpopt/amp/scale``              the loss scale this step's backward ran with                        GradScaler
    ``ddpopt/amp/skipped_steps``      optimizer steps the scaler skipped so far (inf/NaN found)           GradScaler
    ``ddpopt/amp/skip_rate``          skipped share of the last ``window`` steps                          GradScaler
    ``ddpopt/amp/growth_events``      scale growths so far                                                GradScaler
    ``ddpopt/amp/backoff_events``     scale backoffs so far (one per overflow)                            GradScaler
    ``ddpopt/amp/nonfinite_steps``    checks that found non-finite values (see ``nonfinite_every``)      no scaler
    ================================  ==================================================================  ===========

    Warns once when the scale falls below ``underflow_threshold`` (gradients are underflowing) and once when the
    skip rate over a full window exceeds ``skip_rate_threshold``, with the advice to use bf16 where the hardware
    has it (and saying whether it does).

    Args:
        window: optimizer steps over which ``skip_rate`` is computed.
        skip_rate_threshold: warn when the skip rate over a full window exceeds this.
        underflow_threshold: warn when the loss scale falls below this.
        skip_scheduler_on_overflow: keep step-interval LR schedulers from stepping on skipped optimizer steps
            (Lightning steps them anyway, and torch warns "Detected call of lr_scheduler.step() before
            optimizer.step()").
        check_nonfinite: run the non-finite gradient check when there is no GradScaler.
        nonfinite_every: check every this many optimizer steps (1: every step, exactly that step's gradients). A
            check is a pass over every gradient on the rank's device; where that pass is a noticeable part of a
            short step, a larger value checks the gradients and the parameters together (a non-finite gradient
            leaves its parameter non-finite) every that many steps and reports the steps since the last check, at
            2 / ``nonfinite_every`` passes a step (under local SGD the check is at each parameter sync anyway).
        on_nonfinite: ``"warn"``, ``"stop"`` (the Trainer stops after the step on every rank) or ``"raise"``
            (``FloatingPointError`` on every rank).
        max_names: how many offending parameters to name.
    """

    summary_key = "amp"
    tensorboard_charts = charts(
        "ddpopt AMP",
        "ddpopt/amp",
        {
            "loss scale": ["scale"],
            "skip rate": ["skip_rate"],
            "skipped steps and scale changes": ["skipped_steps", "backoff_events", "growth_events"],
            "steps with non-finite gradients (no scaler)": ["nonfinite_steps"],
        },
    )

    def __init__(
        self,
        window: int = 100,
        skip_rate_threshold: float = 0.1,
        underflow_threshold: float = 1.0,
        skip_scheduler_on_overflow: bool = False,
        check_nonfinite: bool = True,
        on_nonfinite: OnNonFinite = "warn",
        max_names: int = 5,
        nonfinite_every: int = 1,
    ) -> None:
        require_int("window", window, 1)
        require_int("nonfinite_every", nonfinite_every, 1)
        if not isinstance(skip_rate_threshold, int | float) or not 0 <= skip_rate_threshold <= 1:
            raise ValueError(f"skip_rate_threshold={skip_rate_threshold!r} must be between 0 and 1")
        require_number("underflow_threshold", underflow_threshold)
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not valid; choose one of {list(_ON_NONFINITE)}")
        require_int("max_names", max_names, 1)
        self.window = window
        self.skip_rate_threshold = skip_rate_threshold
        self.underflow_threshold = underflow_threshold
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.check_nonfinite = check_nonfinite
        self.nonfinite_every = nonfinite_every
        self.on_nonfinite = on_nonfinite
        self.max_names = max_names

        self.steps = 0
        self.skipped_steps = 0
        self.growth_events = 0
        self.backoff_events = 0
        self.nonfinite_steps = 0
        self.skipped_step_indices: list[int] = []
        self.nonfinite_reports: list[dict[str, Any]] = []
        self._recent: deque[bool] = deque(maxlen=window)
        self._last_scale: float | None = None
        self._warned_underflow = False
        self._warned_skip_rate = False
        self._last_step_skipped = False
        self._warned_unclassified = False
        self._scaler: torch.amp.GradScaler | None = None
        self._checked_through = 0  # the last optimizer step whose gradients (or parameters) were checked
        self._patched_module: pl.LightningModule | None = None
        self._exchange = Exchange()  # every rank's verdict, in flight from a meeting in passing to the next check
        self._in_flight: _Found | None = None
        # On a GPU, the last check's verdict on its way to the host, read at the next check, and what it found.
        self._deferred: tuple[DeferredRead, _Found] | None = None

    @property
    def last_step_skipped(self) -> bool:
        """Whether the GradScaler skipped the last optimizer step (an overflow)."""
        return self._last_step_skipped

    def summary(self) -> dict[str, Any]:
        """Counts and the latest scale, for the diagnosis."""
        return {
            "scaler": self._scaler is not None,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skip_rate,
            "recent_steps": len(self._recent),
            "skip_rate_threshold": self.skip_rate_threshold,
            "window": self.window,
            "scale": self._last_scale,
            "underflow_threshold": self.underflow_threshold,
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_reports": self.nonfinite_reports[-3:],
        }

    @property
    def skip_rate(self) -> float:
        """Skipped share of the last ``window`` optimizer steps (0 before the first)."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._checked_through = self.steps
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scaler = scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.skip_scheduler_on_overflow and self._scaler is not None):
            return
        step_schedulers = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        if not step_schedulers:
            return
        # Wrap the module's lr_scheduler_step hook (an instance attribute, gone at teardown) rather than the
        # schedulers: a scheduler's state_dict holds every attribute it has, and a wrapper cannot be saved.
        original = pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any | None) -> None:
            if self._last_step_skipped and id(scheduler) in step_schedulers:
                return
            original(scheduler, metric)

        pl_module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._patched_module = pl_module

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_layout_if_first(trainer, self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._exchange.drop()
        self._in_flight = self._deferred = None
        if self._patched_module is not None:
            del self._patched_module.lr_scheduler_step
            self._patched_module = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.steps += 1
        if self._scaler is not None:
            self._observe_scaler(trainer, pl_module, optimizer, self._scaler)
        elif self.check_nonfinite:
            self._check_nonfinite(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._scaler is None and self.check_nonfinite:
            # The end of fit is a meeting: a verdict still in flight arrives, and local SGD's steps since its last
            # sync (the same on every rank) are checked.
            if self._checked_through < self.steps:
                # No logs at the end of fit.
                self._decide_nonfinite(
                    trainer, pl_module, parameters=True, log=False, checked="checked at the end of fit"
                )
            else:
                self._decide_earlier(trainer)
        report_if_last(trainer, self)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _COUNTS},
            "skipped_step_indices": list(self.skipped_step_indices),
            "recent": list(self._recent),
            "last_scale": self._last_scale,
            "warned_underflow": self._warned_underflow,
            "warned_skip_rate": self._warned_skip_rate,
            "checked_through": self._checked_through,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in _COUNTS:
            setattr(self, name, state_dict[name])
        # The steps a check every ``nonfinite_every`` had not covered yet at the save (older states: none).
        self._checked_through = state_dict.get("checked_through", self.steps)
        self.skipped_step_indices = list(state_dict["skipped_step_indices"])
        self._recent = deque(state_dict["recent"], maxlen=self.window)
        self._last_scale = state_dict["last_scale"]
        self._warned_underflow = state_dict["warned_underflow"]
        self._warned_skip_rate = state_dict["warned_skip_rate"]

    def _observe_scaler(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
    ) -> None:
        scale = scaler.get_scale()
        if self._last_scale is not None and scale > self._last_scale:
            self.growth_events += 1
        self._last_scale = scale
        # What GradScaler.step itself reads to decide whether to skip: filled in by unscale_, which Lightning
        # runs before this hook. The values are synced to the host by GradScaler.step anyway.
        found_inf = found_inf_per_device(scaler, optimizer)
        if not found_inf and not self._warned_unclassified:
            # Optimizers that unscale inside step() (fused ones) leave nothing to read before the step.
            self._warned_unclassified = True
            rank_zero_warn(
                f"ddpopt: AMPMonitor cannot tell skipped steps for {type(optimizer).__name__}, which unscales its "
                "gradients inside step(); skipped_steps stays 0 and only the loss scale is logged for it."
            )
        skipped = bool(sum(value.item() for value in found_inf.values()))
        self._last_step_skipped = skipped
        self._recent.append(skipped)
        if skipped:
            self.skipped_steps += 1
            self.backoff_events += 1
            self.skipped_step_indices.append(self.steps)
        metrics = {
            "scale": scale,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skip_rate,
            "recent_steps": len(self._recent),
            "growth_events": self.growth_events,
            "backoff_events": self.backoff_events,
        }
        for key, value in metrics.items():
            pl_module.log(f"ddpopt/amp/{key}", float(value), on_step=True, on_epoch=False)

        if scale < self.underflow_threshold and not self._warned_underflow:
            self._warned_underflow = True
            rank_zero_warn(
                f"ddpopt: the AMP loss scale fell to {scale:g}, below {self.underflow_threshold:g}, at optimizer step "
                f"{self.steps}: gradients are underflowing fp16 or are non-finite every step. "
                f"{bf16_supported(pl_module.device)[1]}."
            )
        if (
            len(self._recent) == self.window
            and self.skip_rate > self.skip_rate_threshold
            and not self._warned_skip_rate
        ):
            self._warned_skip_rate = True
            rank_zero_warn(
                f"ddpopt: the GradScaler skipped {self.skip_rate:.0%} of the last {self.window} optimizer steps "
                f"(threshold {self.skip_rate_threshold:.0%}): those batches trained nothing. "
                f"{bf16_supported(pl_module.device)[1]}."
            )

    def _check_nonfinite(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if gradients_synchronised(trainer):
            if self.nonfinite_every == 1:
                self._decide_nonfinite(trainer, pl_module, parameters=False)
            elif self.steps % self.nonfinite_every == 0:
                every = f"checked every {self.nonfinite_every} steps"
                self._decide_nonfinite(trainer, pl_module, parameters=True, checked=every)
        elif next_step_meets(trainer):
            in_passing = meets_in_passing(trainer)
            self._decide_nonfinite(trainer, pl_module, parameters=True, in_passing=in_passing, checked=_AT_SYNCS)

    def _decide_nonfinite(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        parameters: bool,
        in_passing: bool = False,
        log: bool = True,
        checked: str = "",
    ) -> None:
        """Check the steps since the last check, and decide on every rank alike whether any rank found non-finite.

        ``parameters``: check the parameters too, which cover the steps since the last check (between local SGD's
        syncs: a non-finite gradient leaves its parameter non-finite after the optimizer step). Called only where
        the ranks meet anyway (:mod:`lightning_ddpopt.meetings`), so it adds no barrier: gradients every rank holds
        alike decide without a collective; otherwise every rank's verdict is exchanged, in flight until the next
        check where the ranks meet only in passing (``in_passing``). ``checked``: when such checks come, for the
        report.
        """
        self._decide_earlier(trainer)
        steps = list(range(self._checked_through + 1, self.steps + 1)) or [self.steps]
        self._checked_through = self.steps
        alike = trainer.world_size == 1 or (not parameters and gradients_identical(trainer))
        if alike and not parameters and trainer.world_size > 1 and hook_found_finite(trainer):
            # The hook found every reduced value finite (every rank's verdict alike): no pass over the gradients.
            self._log_count(pl_module, log)
            return
        named = [
            (name, p)
            for name, p in pl_module.named_parameters()
            if p.grad is not None or (parameters and p.requires_grad)
        ]
        # One sum per tensor, on the device: a NaN or an infinity makes the sum non-finite, and a sum of finite
        # values is finite unless it overflows float32 (3.4e38). One pass over the values, where an elementwise
        # test writes and reads a mask as large as the gradient (several times the cost).
        sums = [_sum(p, parameters) for _, p in named]
        bad = ~torch.stack(sums).isfinite() if sums else torch.zeros(0, dtype=torch.bool)
        # A rank without gradients still takes part: every rank must take the same branch.
        flag = bad.any().to(device=pl_module.device, dtype=torch.uint8).reshape(1)
        found = _Found(steps, [name for name, _ in named], bad, parameters, alike, checked)
        verdict: torch.Tensor
        if alike:
            verdict = flag  # the same gradients on every rank: the same verdict, no collective
        elif dist.is_available() and dist.is_initialized():
            # One collective (the strategy's reduce adds a barrier); in passing it stays in flight to the next check.
            flags = self._exchange.gather(flag, trainer.world_size, in_passing, final=not log)
            if flags is None:
                self._in_flight = found
                self._log_count(pl_module, log)
                return
            verdict = flags.max()
        else:
            verdict = trainer.strategy.reduce(flag.float(), reduce_op="sum")
        if verdict.is_cuda and log:
            # On a GPU the verdict is read at the next check, a step later, when the device has long computed it:
            # no host sync (at the end of fit, ``log=False``, it is read at once).
            self._deferred = (DeferredRead(verdict.reshape(()).bool()), found)
        elif bool(verdict.item()):
            self._report_nonfinite(trainer, found)
        self._log_count(pl_module, log)

    def _decide_earlier(self, trainer: pl.Trainer) -> None:
        """Act on the previous check's verdicts, every rank alike: exchanged in passing, or deferred on a GPU."""
        flags, found = self._exchange.arrived(), self._in_flight
        self._in_flight = None
        if flags is not None and found is not None and bool(flags.max().item()):
            self._report_nonfinite(trainer, found)
        deferred, self._deferred = self._deferred, None
        if deferred is not None and bool(deferred[0].read()):
            self._report_nonfinite(trainer, deferred[1])

    def _log_count(self, pl_module: pl.LightningModule, log: bool) -> None:
        if log:
            pl_module.log("ddpopt/amp/nonfinite_steps", float(self.nonfinite_steps), on_step=True, on_epoch=False)

    def _report_nonfinite(self, trainer: pl.Trainer, found: _Found) -> None:
        self.nonfinite_steps += 1
        steps, parameters = found.steps, found.parameters
        names = [name for name, b in zip(found.names, found.bad.tolist(), strict=True) if b][: self.max_names]
        per_rank: list[list[str]] = [names] * trainer.world_size  # alike: the same gradients, the same names
        if not found.alike and dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            per_rank = [[] for _ in range(trainer.world_size)]
            dist.all_gather_object(per_rank, names)
        by_rank = dict(enumerate(per_rank))
        self.nonfinite_reports.append({"step": steps[-1], "steps": steps, "names": by_rank})
        where = "; ".join(f"rank {rank}: {', '.join(n) or 'none'}" for rank, n in by_rank.items())
        when = (
            f"gradients at optimizer step {steps[0]}"
            if not parameters
            else f"values in optimizer steps {steps[0]}-{steps[-1]} ({found.checked})"
        )
        message = (
            f"ddpopt: non-finite {when} (rank {trainer.global_rank} reporting), first offending parameters - {where}"
        )
        if self.on_nonfinite == "raise":
            raise FloatingPointError(message)
        if trainer.is_global_zero:  # every rank's names are in the message: one copy of it is enough
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        if self.on_nonfinite == "stop":
            trainer.should_stop = True


_AT_SYNCS = "local SGD: checked at each parameter sync"
#: The counters a checkpoint keeps under their own names.
_COUNTS = ("steps", "skipped_steps", "growth_events", "backoff_events", "nonfinite_steps")


@dataclass(frozen=True)
class _Found:
    """One check's local result: the steps it covers, the tensors checked and which of them were non-finite."""

    steps: list[int]
    names: list[str]
    bad: torch.Tensor
    parameters: bool
    alike: bool = False  # every rank checked the same values (no exchange of names needed)
    checked: str = ""  # when checks come, for the report: with the parameters, a check covers several steps


def _sum(parameter: torch.nn.Parameter, with_values: bool) -> torch.Tensor:
    """The float32 sum of ``parameter``'s gradient, plus its values' with ``with_values``."""
    tensors = [t for t in (parameter.grad, parameter.detach() if with_values else None) if t is not None]
    total = tensors[0].sum(dtype=torch.float32)
    return total + tensors[1].sum(dtype=torch.float32) if len(tensors) == 2 else total
