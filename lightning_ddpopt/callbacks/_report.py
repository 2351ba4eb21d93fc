"""The end-of-fit report, written once by whichever measuring callback runs last, so any of them alone gets one."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt.callbacks._tensorboard import write_findings
from lightning_ddpopt.diagnosis import REPORT_NAME, diagnose, format_findings, summarize
from lightning_ddpopt.measuring import MeasuringCallback

__all__ = ["report_if_last"]


def report_if_last(trainer: pl.Trainer, callback: object) -> Path | None:
    """Write the report if ``callback`` is the run's last measuring callback; every rank must call this.

    Returns the report's path on rank 0, ``None`` elsewhere or when another callback writes it. A ``CommProfiler``
    with ``report=False`` turns the report off. The per-rank series come from ``CommProfiler`` when present. The
    findings also go to every TensorBoard logger, as text.
    """
    measuring = [c for c in trainer.callbacks if isinstance(c, MeasuringCallback)]  # type: ignore[attr-defined]
    if not measuring or measuring[-1] is not callback or not all(c.report for c in measuring):
        return None
    directory = Path(trainer.log_dir or trainer.default_root_dir)  # log_dir broadcasts: every rank must ask
    if not trainer.is_global_zero:
        return None
    summary = summarize(trainer)
    findings = diagnose(summary)
    print("\n" + format_findings(findings), flush=True)  # a line of their own, not the progress bar's
    write_findings(trainer, findings)
    series: dict[str, Any] = next((c.report_series for c in measuring if c.report_series is not None), {})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / REPORT_NAME
    payload = {
        "version": 1,
        "summary": summary,
        "findings": [finding.as_dict() for finding in findings],
        "series": series,
    }
    path.write_text(json.dumps(_finite(payload), indent=1))
    rank_zero_info(f"ddpopt: report written to {path}")
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by ``None``, which JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
