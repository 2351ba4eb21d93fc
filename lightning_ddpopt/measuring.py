"""What the strategies and the measuring callbacks show the report and the callbacks, typed: the one contract.

:class:`MeasuringCallback` is the base of ``CommProfiler``, ``StragglerDetector`` and ``AMPMonitor``: the report
(:mod:`lightning_ddpopt.callbacks._report`) and the summary (:func:`lightning_ddpopt.diagnosis.summarize`) find them
by it. :class:`FrontEnd` tells a Fabric loop's view of the run from the Trainer. The strategies' side of the contract
is :class:`lightning_ddpopt.core.CoreViews`, which both strategies inherit; what reads it checks ``isinstance``, so a
renamed attribute fails mypy, not silently at run time.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lightning.pytorch.callbacks import Callback

__all__ = ["FrontEnd", "MeasuringCallback"]


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
