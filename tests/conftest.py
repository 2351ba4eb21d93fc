"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_group(tmp_path):
    """A 1-rank gloo process group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """An in-process Trainer run leaves Lightning's default group behind; later tests need a clean slate."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
