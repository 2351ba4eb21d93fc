"""A small causal transformer trained with AdamW on real text (Python's own pydoc topics, nothing downloaded):
each recommended option keeps the held-out loss within its stated bound of plain allreduce's, and the lossy hooks'
measured compression error stays under the bound the diagnosis uses for an adaptive optimizer.

The model and data are the ones of ``benchmarks/transformer_quality.py``, smaller (width 64, 80 steps) to fit the
suite; that benchmark publishes the full-size figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy
from lightning_ddpopt.diagnosis import COMPRESSION_ERROR_LIMITS
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import fit_ddp, load_script

STEPS = 80


bench = load_script("benchmarks/transformer_quality.py")
_DATA = bench.text_bytes()
_SPLIT = int(0.9 * _DATA.numel())
TRAIN = bench.windows(_DATA[:_SPLIT], stride=bench.CONTEXT)
HELD_OUT = bench.windows(_DATA[_SPLIT:], stride=bench.CONTEXT)


def _held_out(tmp_path: Path, strategy: OptimizedDDPStrategy) -> dict:
    """Fit the GPT for STEPS steps on 2 ranks (batch 16 per rank); rank 0's held-out loss and measured figures."""
    out = tmp_path / "result.json"
    torch.manual_seed(0)
    loader = DataLoader(TRAIN, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    fit_ddp(
        tmp_path,
        strategy,
        model=bench.TinyGPT(width=64, layers=2, heads=2),
        loader=loader,
        callbacks=[bench.HeldOut(HELD_OUT, out)],  # also has the ledger measure every 5th sync's error
        max_steps=STEPS,
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def allreduce_loss(tmp_path_factory):
    loss = _held_out(tmp_path_factory.mktemp("allreduce"), OptimizedDDPStrategy(start_method="fork"))["held_out"]
    assert loss < 3.0  # it learned: a uniform guess over bytes is ln(256) = 5.5 nats
    return loss


#: option -> (strategy arguments, the largest held-out loss increase over allreduce's it may cost). Measured when
#: the bounds were set: fp16 +0.01%, int8 +0.02%, PowerSGD's default +0.20% (a fixed rank 4: +1.6%, rank 1: +5.4%),
#: parameter averaging every 4 steps +0.69%, overlapped DiLoCo every 16 steps +1.68%.
OPTIONS = {
    "fp16": ({"comm_hook": "fp16"}, 0.005),
    "int8": ({"comm_hook": "int8"}, 0.005),
    "powersgd": ({"comm_hook": "powersgd"}, 0.01),  # the default: its rank rises while the error is above 0.6
    "localsgd4": ({"local_sgd": LocalSGDConfig.post_local_sgd(4)}, 0.02),
    "diloco16_overlap": ({"local_sgd": LocalSGDConfig.diloco(16, overlap_steps=8)}, 0.03),
}


@pytest.mark.parametrize(
    # fp16 and parameter averaging every 4 steps (each a lighter form of int8 and of DiLoCo) in the slow run
    "option",
    [pytest.param(option, marks=pytest.mark.slow if option in ("fp16", "localsgd4") else ()) for option in OPTIONS],
)
def test_option_keeps_the_transformers_held_out_loss(tmp_path, allreduce_loss, option):
    arguments, bound = OPTIONS[option]
    result = _held_out(tmp_path, OptimizedDDPStrategy(start_method="fork", **arguments))
    change = result["held_out"] / allreduce_loss - 1
    print(f"transformer: {option} {result['held_out']:.4f} ({change:+.2%}), allreduce {allreduce_loss:.4f}")
    assert change <= bound, f"{option}: {result['held_out']:.4f} vs allreduce {allreduce_loss:.4f} ({change:+.2%})"
    if option in ("fp16", "int8"):  # under the diagnosis's bound for an adaptive optimizer
        assert 0 < result["error"] <= COMPRESSION_ERROR_LIMITS["int8" if option == "int8" else "cast"][0]
    if option == "powersgd":  # rank 4 alone costs this model more (see the benchmark): the bound raised it
        assert result["rank"] > 4 and result["rises"]


@pytest.mark.slow
def test_a_fixed_rank_4_costs_this_model_more_than_the_defaults_bound(tmp_path, allreduce_loss):
    # What the default's error bound is for: without it, PowerSGD's rank 4 loses more than the bound above.
    config = PowerSGDConfig(rank=4, max_error=None)
    result = _held_out(tmp_path, OptimizedDDPStrategy(start_method="fork", comm_hook=config))
    change = result["held_out"] / allreduce_loss - 1
    print(f"transformer: fixed rank 4 {result['held_out']:.4f} ({change:+.2%}), allreduce {allreduce_loss:.4f}")
    assert change > OPTIONS["powersgd"][1]
    assert result["error"] > COMPRESSION_ERROR_LIMITS["powersgd"][0]  # and the finding would say so
