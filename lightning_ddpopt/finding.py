"""One line of the diagnosis: :class:`Finding` (made by :mod:`lightning_ddpopt.diagnosis` and its areas' modules)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["FINDINGS_TITLE", "Finding", "Status"]

Status = Literal["problem", "ok", "unknown"]
#: The findings' heading, in the order the diagnosis looks (the report's and TensorBoard's).
FINDINGS_TITLE = "ddpopt findings (network -> compression -> AMP -> accumulation -> stragglers)"


@dataclass(frozen=True)
class Finding:
    """One line of the diagnosis.

    Attributes:
        area: ``"network"``, ``"compression"``, ``"amp"``, ``"accumulation"``, ``"stragglers"`` or ``"islands"``.
        status: ``"problem"``, ``"ok"`` or ``"unknown"`` (not measured).
        evidence: the figures behind the verdict.
        recommendation: what to do; empty when nothing needs doing.
    """

    area: str
    status: Status
    evidence: str
    recommendation: str = ""

    def as_dict(self) -> dict[str, str]:
        """The finding as a JSON-ready dict."""
        return asdict(self)
