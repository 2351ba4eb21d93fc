"""CPU-core binding plans."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_ddpopt.affinity import CoreBinding, available_cores, plan_core_sets


def test_plan_splits_cores_evenly_and_disjointly():
    assert plan_core_sets(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_core_sets(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan_core_sets([4, 9], 2) == [[4], [9]]


def test_plan_refuses_fewer_cores_than_ranks():
    with pytest.raises(ValueError, match=r"3 local ranks but only 2 usable cores \[0, 1\]"):
        plan_core_sets([0, 1], 3)


def test_binding_pins_and_restores():
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = available_cores()[-1]
    binding = CoreBinding([core])
    try:
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
    finally:
        binding.release()
    assert os.sched_getaffinity(0) == before_cores
    assert torch.get_num_threads() == before_threads
