"""What TensorBoard shows of a run: a chart layout for the ``ddpopt/*`` scalars and the findings as text.

The scalars themselves reach every logger through ``LightningModule.log``; this module only adds what TensorBoard
can show besides them, for each ``TensorBoardLogger`` among the Trainer's (or Fabric's) loggers (other loggers are
left alone):

- at the start of training, a layout for TensorBoard's *Custom Scalars* tab: one section per measuring callback
  ("ddpopt network", "ddpopt stragglers", "ddpopt AMP"), related series on one chart (e.g. the sync's span beside its
  exposed part and the link's busy time), written once by the first measuring callback for all of them;
- at the end of fit, the findings table as text (tag ``ddpopt/findings``, the *Text* tab).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.loggers import TensorBoardLogger  # the base of the Trainer's too

from lightning_ddpopt.finding import FINDINGS_TITLE, Finding
from lightning_ddpopt.measuring import MeasuringCallback

__all__ = ["FINDINGS_TAG", "Charts", "charts", "findings_markdown", "write_findings", "write_layout_if_first"]

#: The text tag the findings are written under.
FINDINGS_TAG = "ddpopt/findings"

#: A measuring callback's section of the layout: its title and {chart title: tag regexes drawn on that chart}.
Charts = tuple[str, dict[str, list[str]]]


def charts(section: str, prefix: str, keys_per_chart: dict[str, list[str]]) -> Charts:
    """A layout section whose charts draw the scalars ``{prefix}/{key}`` (each tag matched exactly).

    A key starting with ``/`` is a whole tag of its own (e.g. the strategy's ``/ddpopt/effective_batch_size``).
    """
    tags = {
        chart: [key[1:] if key.startswith("/") else f"{prefix}/{key}" for key in keys]
        for chart, keys in keys_per_chart.items()
    }
    return section, {chart: [f"^({'|'.join(map(re.escape, keys))})$"] for chart, keys in tags.items()}


def _writers(trainer: pl.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger, on rank 0 (the loggers write there only)."""
    if not trainer.is_global_zero:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def write_layout_if_first(trainer: pl.Trainer, callback: object) -> bool:
    """Write the Custom Scalars layout of every measuring callback if ``callback`` is the first of them.

    TensorBoard keeps one layout per run, so one callback writes the sections of all. Returns whether it was written.
    """
    measuring = [c for c in trainer.callbacks if isinstance(c, MeasuringCallback)]  # type: ignore[attr-defined]
    writers = _writers(trainer)
    if not writers or not measuring or measuring[0] is not callback:
        return False
    sections: Sequence[Charts] = [c.tensorboard_charts for c in measuring]
    layout = {section: {chart: ["Multiline", tags] for chart, tags in charts.items()} for section, charts in sections}
    for writer in writers:
        writer.add_custom_scalars(layout)
    return True


def write_findings(trainer: pl.Trainer, findings: Sequence[Finding]) -> None:
    """Write the findings as a Markdown table under :data:`FINDINGS_TAG` at the current step."""
    for writer in _writers(trainer):
        writer.add_text(FINDINGS_TAG, findings_markdown(findings), global_step=trainer.global_step)
        writer.flush()


def findings_markdown(findings: Sequence[Finding]) -> str:
    """The findings as a Markdown table, in diagnosis order (TensorBoard's Text tab renders Markdown)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ") or "-"

    rows = [f"| {f.area} | {f.status.upper()} | {cell(f.evidence)} | {cell(f.recommendation)} |" for f in findings]
    header = "| area | status | evidence | recommendation |\n|---|---|---|---|"
    return "\n".join([FINDINGS_TITLE, "", header, *rows])
