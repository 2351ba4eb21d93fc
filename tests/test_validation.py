"""Bad input raises at construction (or at setup where only then knowable), naming argument, value and choices."""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ddpopt import COMM_HOOKS, OptimizedDDPStrategy
from lightning_ddpopt.affinity import available_cores
from tests.helpers import StackModel, regression_data

pytestmark = pytest.mark.quick


def test_unknown_hook_name_lists_the_choices():
    with pytest.raises(ValueError, match=re.escape("comm_hook='fp8' is not a known hook; choose one of")) as error:
        OptimizedDDPStrategy(comm_hook="fp8")
    for name in COMM_HOOKS:
        assert repr(name) in str(error.value)


def test_hook_that_is_neither_name_callable_nor_none():
    expected = r"comm_hook=42 must be a registry name \(str\), a PowerSGDConfig, an Int8Config, an AutoConfig, a call"
    with pytest.raises(TypeError, match=expected):
        OptimizedDDPStrategy(comm_hook=42)


def test_hook_callable_with_wrong_signature():
    def one_argument(bucket):
        return bucket

    def wrongly_named(state, grads):
        return grads

    for hook in (one_argument, wrongly_named):
        with pytest.raises(TypeError, match=r"must take two positional arguments named \(state, bucket\)"):
            OptimizedDDPStrategy(comm_hook=hook)
    with pytest.raises(TypeError, match=r"ddp_comm_hook=.*one_argument.* must take two positional"):
        OptimizedDDPStrategy(ddp_comm_hook=one_argument)


def test_comm_hook_and_ddp_comm_hook_together():
    with pytest.raises(ValueError, match=r"comm_hook='fp16' and ddp_comm_hook=.* both given; pass one of them"):
        OptimizedDDPStrategy(comm_hook="fp16", ddp_comm_hook=default_hooks.allreduce_hook)


def test_comm_state_needs_a_callable_hook():
    with pytest.raises(ValueError, match=r"comm_state=.* is only used with a callable comm_hook"):
        OptimizedDDPStrategy(comm_hook="fp16", comm_state=object())
    with pytest.raises(ValueError, match=r"comm_state=.* given without a callable comm_hook"):
        OptimizedDDPStrategy(comm_hook=None, comm_state=object())


def test_ddp_comm_wrapper_without_hook():
    with pytest.raises(ValueError, match=r"ddp_comm_wrapper=.* wraps ddp_comm_hook, which is not given"):
        OptimizedDDPStrategy(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)


@pytest.mark.parametrize("value", [0, -1, -0.5, math.nan, math.inf])
def test_bucket_cap_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match=re.escape(f"bucket_cap_mb={value!r} must be a positive, finite number")):
        OptimizedDDPStrategy(bucket_cap_mb=value)


def test_bucket_cap_unknown_word_and_wrong_type():
    with pytest.raises(
        ValueError,
        match=re.escape("bucket_cap_mb='big' is not valid; pass a positive number of MiB or one of ['auto']"),
    ):
        OptimizedDDPStrategy(bucket_cap_mb="big")
    for value in (True, None, [25]):
        with pytest.raises(TypeError, match=re.escape(f"bucket_cap_mb={value!r} must be a positive number of MiB")):
            OptimizedDDPStrategy(bucket_cap_mb=value)


def test_cpu_affinity_bad_values():
    usable = available_cores()
    with pytest.raises(
        TypeError, match="cpu_affinity='all' must be True, False, or one list of core ids per local rank"
    ):
        OptimizedDDPStrategy(cpu_affinity="all")
    with pytest.raises(
        ValueError,
        match=r"cpu_affinity\[0\] names core 4096, which this process cannot use; usable cores: "
        + re.escape(str(usable)),
    ):
        OptimizedDDPStrategy(cpu_affinity=[[4096]])
    with pytest.raises(ValueError, match=f"gives core {usable[0]} to more than one rank"):
        OptimizedDDPStrategy(cpu_affinity=[[usable[0]], [usable[0]]])
    with pytest.raises(TypeError, match=r"cpu_affinity\[0\]=\[\] must be a non-empty list of core ids"):
        OptimizedDDPStrategy(cpu_affinity=[[]])
    with pytest.raises(ValueError, match=r"cpu_affinity=\[\] names no cores"):
        OptimizedDDPStrategy(cpu_affinity=[])


def test_cpu_affinity_true_with_more_local_ranks_than_cores_fails_at_setup():
    strategy = OptimizedDDPStrategy(cpu_affinity=True)
    ranks = len(available_cores()) + 1
    with pytest.raises(ValueError, match=f"needs at least one core per local rank: {ranks} local ranks but only"):
        _start(strategy, local_ranks=ranks)


def test_cpu_affinity_list_must_match_local_ranks_at_setup():
    strategy = OptimizedDDPStrategy(cpu_affinity=[[available_cores()[0]]])
    with pytest.raises(ValueError, match="cpu_affinity gives 1 core sets but there are 2 local ranks"):
        _start(strategy, local_ranks=2)


def _start(strategy: OptimizedDDPStrategy, local_ranks: int) -> None:
    """What the strategy's setup_environment starts once the process group exists: binding the cores first."""
    cpu = torch.device("cpu")
    strategy._core.start(cpu, local_rank=0, local_world_size=local_ranks, node_rank=0, world_size=local_ranks, rank=0)


def test_static_graph_with_accumulation_is_refused_at_setup(tmp_path):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=OptimizedDDPStrategy(static_graph=True),
        accumulate_grad_batches=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ValueError, match=r"static_graph=True cannot be combined with accumulate_grad_batches=2"):
        trainer.fit(StackModel(), torch.utils.data.DataLoader(regression_data(8), batch_size=4))


@pytest.mark.parametrize("rank", [0, 1])
def test_untested_lightning_is_warned_once_on_rank_zero(rank, monkeypatch):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_ddpopt import _compat

    monkeypatch.setattr(_compat, "LIGHTNING_TESTED_RANGE", ("0.1.0", "0.2.0"))
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OptimizedDDPStrategy()
    ours = [w for w in caught if "is tested with lightning" in str(w.message)]
    assert len(ours) == (1 if rank == 0 else 0)
    if rank == 0:
        assert str(ours[0].message).startswith("lightning_ddpopt is tested with lightning>=0.1.0,<0.2.0; lightning ")
        assert ours[0].filename == __file__  # points at the user's line, not the package
