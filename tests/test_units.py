"""One unit convention: decimal bytes scaled to the figure (B, kB, MB, GB), bucket caps in MiB."""

from __future__ import annotations

import json

import pytest
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from lightning_ddpopt.buckets import BucketController, plan_buckets
from lightning_ddpopt.cli import main as ddpopt
from lightning_ddpopt.units import MIB, byte_unit, format_bytes, format_seconds
from tests.helpers import StackModel

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (12, "12 B"),
        (999, "999 B"),
        (999.7, "1 kB"),  # rounded up to the next unit, not "1000 B"
        (999_999, "1 MB"),
        (2_100, "2.1 kB"),
        (150_000, "150 kB"),
        (4_506_000, "4.51 MB"),
        (MIB, "1.05 MB"),
        (25.2e6, "25.2 MB"),
        (101e6, "101 MB"),
        (1.5e9, "1.5 GB"),
    ],
)
def test_format_bytes_scales_the_unit(nbytes, text):
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.00042, "0.42 ms"),  # 3 significant digits below 10 ms, not "0 ms"
        (0.0099, "9.9 ms"),
        (0.0204, "20 ms"),
        (0.9994, "999 ms"),
        (0.9996, "1.00 s"),  # not "1000 ms"
        (1.234, "1.23 s"),
    ],
)
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_byte_unit():
    assert byte_unit(999) == (1.0, "B") and byte_unit(1000) == (1e3, "kB") and byte_unit(3e9) == (1e9, "GB")


def test_sizes_agree_with_lightnings_model_summary():
    model = StackModel()
    lightning_mb = ModelSummary(model).model_size  # Lightning's "params size (MB)", 10^6 bytes
    ours = sum(p.numel() * p.element_size() for p in model.parameters())
    assert format_bytes(ours) == format_bytes(lightning_mb * 1e6)
    assert format_bytes(ours).endswith(" kB") or format_bytes(ours).endswith(" MB")


def test_layout_line_writes_bytes_in_mb_and_the_cap_in_mib():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8.4 MB of gradients
    buckets = BucketController(5.0)
    buckets.plan = plan_buckets(model, 5, world_size=2)
    line = buckets._describe(buckets.plan.predicted_bucket_bytes)
    assert line == "8.4 MB of gradients in 1 bucket (cap 5.24 MB: bucket_cap_mb=5), hook none (DDP built-in allreduce)"


def test_plan_table_scales_each_row(capsys):
    assert ddpopt(["plan", "--params", "1M", "--world-size", "2", "--gbps", "1"]) == 0
    rows = {line[:13].strip(): line[13:].split()[:4] for line in capsys.readouterr().out.splitlines()[2:7]}
    # Payload and sent/rank/step (the same at 2 ranks): 4 MB of fp32 gradients; PowerSGD's rank-4 factors of
    # 4096-wide matrices are 7.81 kB, not "0.0 MB".
    assert rows["allreduce"] == ["4", "MB", "4", "MB"] and rows["fp16"] == ["2", "MB", "2", "MB"]
    assert rows["powersgd r4"] == ["7.81", "kB", "7.81", "kB"] and rows["powersgd r64"] == ["125", "kB", "125", "kB"]
    assert ddpopt(["plan", "--params", "1M", "--world-size", "2", "--gbps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["estimates"][0]["payload_bytes"] == 4e6  # JSON stays in bytes
