"""One fit for the network finding's tests: ``python -m tests.network_worker CASE OUT_DIR``, run in a network
namespace whose loopback a test shaped (tests/test_network_finding.py).

``CASE`` is ``saturated`` (many gradient bytes for little compute) or ``busy_backward`` (80 ms of backward compute
between the first bucket and the rest). Two ranks started by Lightning's fork launcher (forked from this fresh
interpreter, which has imported everything already), every measuring callback attached; rank 0 writes
``ddpopt_report.json`` under ``OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector
from tests.helpers import SlowBackwardModel, WideModel, fit_ddp

#: The model and bucket cap (MiB) of each case; a cap under one layer puts the busy backward between buckets.
CASES = {
    "saturated": (lambda: WideModel(extra=4_000_000), 25.0),
    "busy_backward": (lambda: SlowBackwardModel(0.08), 0.25),
}


def main(case: str, out_dir: Path) -> None:
    make_model, bucket_cap_mb = CASES[case]
    fit_ddp(
        out_dir,
        OptimizedDDPStrategy(bucket_cap_mb=bucket_cap_mb, start_method="fork"),
        model=make_model(),
        callbacks=[CommProfiler(every_n_steps=4), StragglerDetector(every_n_steps=4), AMPMonitor()],
        samples=128,  # 8 steps of 8 samples on each of 2 ranks
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
