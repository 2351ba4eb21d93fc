"""Real 2-process CPU (gloo) DDP through Lightning's Trainer."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.affinity import available_cores, cpu_layout, plan_core_sets
from tests.helpers import WIDTH, WarningsProbe, fit_ddp, stack_gradient_bytes, uninterrupted_and_resumed

LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def test_fp16_hook_attached_on_gloo_with_planned_buckets(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook="fp16", bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, max_steps=4)

    for record in ranks:
        assert record["ddp_comm_hook"] == "fp16_allreduce_hook"
        assert record["comm_hook_name"] == "fp16"
        # The cap is applied: DDP fills a bucket until it reaches the cap, so at 0.3 MiB each bucket holds two
        # Linear(256, 256) layers (2 x 263168 bytes), exactly as planned.
        assert record["bucket_layout"] == (2 * LAYER_BYTES,) * 3
        assert record["bucket_plan"]["predicted_bucket_bytes"] == (2 * LAYER_BYTES,) * 3
        steps = record["steps"]
        assert len(steps) == 4
        for step in steps:
            assert step["sync_rounds"] == 1
            assert step["logical_bytes"] == stack_gradient_bytes()
            assert step["wire_bytes"] == stack_gradient_bytes() // 2
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
def test_registry_name_runs_default_allreduce_with_exact_bytes(tmp_path):
    ranks = fit_ddp(tmp_path, "ddp_optimized_fork", max_steps=3)

    for record in ranks:
        assert record["ddp_comm_hook"] == "allreduce_mean_hook"
        assert [step["wire_bytes"] for step in record["steps"]] == [stack_gradient_bytes()] * 3
        assert [step["logical_bytes"] for step in record["steps"]] == [stack_gradient_bytes()] * 3
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
def test_lightning_ddp_comm_hook_runs_on_cpu_and_none_means_builtin(tmp_path):
    # Lightning's DDPStrategy drops ddp_comm_hook on CPU; ours registers it on gloo.
    lightning_style = OptimizedDDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, start_method="fork")
    ranks = fit_ddp(tmp_path / "lightning_style", lightning_style, max_steps=2)
    for record in ranks:
        assert record["ddp_comm_hook"] == "fp16_compress_hook"
        # Timed and sized by the ledger; a foreign hook does not say what it sends.
        assert [(s["logical_bytes"], s["wire_bytes"]) for s in record["steps"]] == [(stack_gradient_bytes(), None)] * 2

    builtin = OptimizedDDPStrategy(comm_hook=None, start_method="fork")
    ranks = fit_ddp(tmp_path / "builtin", builtin, max_steps=2)
    for record in ranks:
        assert record["comm_hook_name"] is None
        assert record["ddp_comm_hook"] in (None, "", "builtin_allreduce")
        assert [s["sync_rounds"] for s in record["steps"]] == [0, 0]
        assert sum(record["bucket_layout"]) == stack_gradient_bytes()
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    def strategy():
        return OptimizedDDPStrategy(comm_hook="fp16", bucket_cap_mb=0.3, start_method="fork")

    uninterrupted, resumed, _ = uninterrupted_and_resumed(tmp_path, strategy)
    # Bit for bit: the same data order, the same deterministic gloo sums, Adam's state restored.
    for before, after in zip(uninterrupted, resumed, strict=True):
        torch.testing.assert_close(after["params"], before["params"], rtol=0, atol=0)
    assert len(resumed[0]["steps"]) == 4  # 64 samples / (8 x 2 ranks) steps in the resumed epoch only


@pytest.mark.quick
def test_cpu_affinity_gives_each_rank_its_own_cores(tmp_path):
    cores = available_cores()
    ranks = fit_ddp(tmp_path, OptimizedDDPStrategy(cpu_affinity=True, start_method="fork"), max_steps=1)

    assert [record["cores"] for record in ranks] == plan_core_sets(cores, 2, cpu_layout(cores))
    assert [record["threads"] for record in ranks] == [len(c) for c in plan_core_sets(cores, 2, cpu_layout(cores))]
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])


@pytest.mark.quick
def test_the_flat_fp16_hook_says_what_it_loses_at_scale(tmp_path, monkeypatch):
    # From FP16_WARN_FROM_RANKS ranks (lowered to 2 here; the forked ranks inherit it) the flat fp16 hook warns once.
    from lightning_ddpopt.hooks import compression

    monkeypatch.setattr(compression, "FP16_WARN_FROM_RANKS", 2)
    out = tmp_path / "warnings.pt"
    strategy = OptimizedDDPStrategy(comm_hook="fp16", start_method="fork")
    fit_ddp(tmp_path, strategy, callbacks=[WarningsProbe(str(out))], max_steps=1)
    warned = [w for w in torch.load(out) if "before fp16 sums it" in w]
    assert warned == [compression.flat_fp16_note(2)]
    assert warned[0].startswith("ddpopt: comm_hook='fp16' syncs flat over 2 ranks and divides each gradient by 2")
