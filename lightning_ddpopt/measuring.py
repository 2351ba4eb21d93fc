"""What the strategies and the measuring callbacks show the report and the callbacks, typed: the one contract.

:class:`MeasuringCallback` is the base of ``CommProfiler``, ``StragglerDetector`` and ``AMPMonitor``: the report
(:mod:`lightning_ddpopt.callbacks._report`) and the summary (:func:`lightning_ddpopt.diagnosis.summarize`) find them
by it. :class:`FrontEnd` tells a Fabric loop's view of the run from the Trainer. The strategies' side of the contract
is :class:`CoreViews`, which both strategies inherit; what reads it checks ``isinstance``, so a renamed attribute
fails mypy, not silently at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

if TYPE_CHECKING:
    from lightning_ddpopt.affinity import CoreBinding
    from lightning_ddpopt.buckets import BucketPlan
    from lightning_ddpopt.core import StrategyCore
    from lightning_ddpopt.fault_tolerance.replica import ReplicaStats
    from lightning_ddpopt.hooks.auto import HookChoice
    from lightning_ddpopt.ledger import CommLedger
    from lightning_ddpopt.localsgd import LocalSGD
    from lightning_ddpopt.topology import TierGroups

__all__ = ["CoreViews", "FrontEnd", "MeasuringCallback"]


class MeasuringCallback(Callback):
    """A callback of this package that measures the run and feeds the end-of-fit report."""

    #: Its area in the run's summary (:func:`lightning_ddpopt.diagnosis.summarize`).
    summary_key: ClassVar[str]
    #: Whether the run's report is written (``CommProfiler(report=False)`` turns it off for every callback).
    report: bool = True
    #: Every rank's series for the report's plots (``CommProfiler``'s, gathered at the end of fit), else ``None``.
    report_series: dict[str, Any] | None = None
    #: Its section of TensorBoard's Custom Scalars layout: a title and its charts' tags (``_tensorboard.charts``).
    tensorboard_charts: ClassVar[tuple[str, dict[str, list[str]]]]

    def summary(self) -> dict[str, Any]:
        """What it measured, JSON-ready, for the report's findings."""
        raise NotImplementedError


class FrontEnd:
    """The run's view a Fabric loop hands the callbacks in place of a Trainer (``"fabric"``); a Trainer is none."""

    #: The front end, for advice worded to it: ``"fabric"``.
    front_end: ClassVar[str] = "fabric"


class CoreViews:
    """What a strategy's :class:`StrategyCore` holds, under the names users and callbacks read.

    Both strategies inherit it; what reads a strategy (:mod:`lightning_ddpopt.meetings`, the callbacks, the
    diagnosis) checks ``isinstance(strategy, CoreViews)`` and reads these typed names, so mypy checks both sides.
    """

    _core: StrategyCore

    @property
    def synced_gradients_identical(self) -> bool:
        """Whether this step's synchronised gradients are the same on every rank (each strategy says when)."""
        raise NotImplementedError

    @property
    def fault_tolerance_stats(self) -> ReplicaStats | None:
        """With ``fault_tolerance``: the steps this island committed and dropped, its heals and quorum changes."""
        ft = self._core.fault_tolerance
        return ft.stats if ft is not None else None

    @property
    def ledger(self) -> CommLedger | None:
        """This rank's :class:`~lightning_ddpopt.ledger.CommLedger` (from process-group setup on)."""
        return self._core.ledger

    @property
    def core_binding(self) -> CoreBinding | None:
        """The cores this rank was bound to with ``cpu_affinity`` (``None`` without)."""
        return self._core.core_binding

    @property
    def comm_state(self) -> object | None:
        """The comm hook's state (``None`` without one)."""
        return self._core.hooks.comm_state

    @property
    def comm_tiers(self) -> TierGroups | None:
        """The intra- and cross-node groups of a two-tier sync (``None`` for a flat one)."""
        return self._core.hooks.tiers

    @property
    def comm_hook_name(self) -> str | None:
        """The registered hook's name."""
        return self._core.hooks.comm_hook_name

    @property
    def hook_choice(self) -> HookChoice | None:
        """What ``comm_hook='auto'`` chose, and why."""
        return self._core.hooks.hook_choice

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The planned bucket cap and predicted layout."""
        return self._core.buckets.plan

    @property
    def bucket_layout(self) -> tuple[int, ...] | None:
        """DDP's bucket sizes once final (the plan's if no hook saw them)."""
        return self._core.buckets.layout

    @property
    def autotuner(self) -> None:
        """Deprecated, always ``None``: ``bucket_cap_mb="autotune"`` means ``"auto"`` now (the design page says why)."""
        rank_zero_deprecation("ddpopt: strategy.autotuner is deprecated and always None: autotune is retired")
        return None

    @property
    def local_sgd(self) -> LocalSGD | None:
        """Local SGD's outer loop (anchor, counters), once the model is wrapped; ``None`` without local SGD."""
        return self._core.local_sgd.loop if self._core.local_sgd is not None else None
