"""The README's main job as a user runs it: what it prints, and that it points only at files it wrote."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_digits.py"
FABRIC_EXAMPLE = EXAMPLE.with_name("fabric_digits.py")


def _run(tmp_path: Path, *args: str, example: Path = EXAMPLE) -> str:
    done = subprocess.run(
        [sys.executable, str(example), "--epochs", "1", "--log-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output.replace("\r", "\n")


def test_two_ranks_print_each_warning_once_and_point_at_what_was_written(tmp_path):
    out = _run(tmp_path, "--devices", "2")
    run_dir = tmp_path / "digits" / "version_0"
    assert f"plot the run: .venv/bin/ddpopt report {run_dir}\n" in out
    assert (run_dir / "ddpopt_report.json").is_file() and (run_dir / "metrics.csv").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))  # TensorBoard beside CSV, in the same run directory
    assert f".venv/bin/tensorboard --logdir {tmp_path}\n" in out
    # No warning line twice (one per rank), and none from the Lightning/torch pytree deprecation.
    warnings = [line for line in out.splitlines() if "Warning" in line or "deprecated" in line]
    assert [line for line, count in collections.Counter(warnings).items() if count > 1] == []
    assert "LeafSpec" not in out
    # Sizes in one unit: the layout line and the summary say the same gradient bytes.
    assert "ddpopt: 4.51 MB of gradients in 2 buckets (cap 1.25 MB: bucket_cap_mb=1.192), hook fp16 on gloo" in out
    assert "4.51 MB of gradients/step, 2.25 MB sent/step" in out


@pytest.mark.slow
def test_one_process_without_callbacks_gives_no_report_hint(tmp_path):
    out = _run(tmp_path, "--devices", "1", "--no-callbacks")
    assert "ddpopt report" not in out and "ddpopt findings" not in out
    assert not list(tmp_path.rglob("ddpopt_report.json"))
    assert "test accuracy: " in out


@pytest.mark.slow
def test_the_fabric_example_accumulates_reports_and_saves(tmp_path):
    out = _run(tmp_path, "--accumulate", "2", "--hook", "int8", example=FABRIC_EXAMPLE)
    run_dir = tmp_path / "fabric_digits" / "version_0"
    assert f"plot the run: .venv/bin/ddpopt report {run_dir}\n" in out
    assert (run_dir / "ddpopt_report.json").is_file() and (run_dir / "metrics.csv").is_file()
    assert (tmp_path / "fabric_digits.ckpt").is_file()
    # 23 batches per rank and epoch in groups of 2: one sync per optimizer step, the epoch's last group shorter.
    assert "1.00 gradient syncs per optimizer step over 1.92 micro-batches" in out
    assert "hook int8: relative compression error" in out
    assert "held-out accuracy: " in out
