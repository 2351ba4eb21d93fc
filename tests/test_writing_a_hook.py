"""The guide's top-k hook (examples/comm_hook_topk.py), registered as docs/guides/writing-a-comm-hook.md shows, gets
what the registry's hooks get: exact bytes in the ledger, the commit rule through an fp16 overflow, identical ranks,
a checkpoint of its state and a bit-exact resume; and the Fabric strategy (slow: 3 ranks)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_ddpopt import AMPMonitor, OptimizedDDPStrategy, fp16_mixed_precision, register_comm_hook
from lightning_ddpopt.hooks import COMM_HOOKS
from tests.helpers import LAYERS, WIDTH, OverflowModel, fit_ddp, load_script, stack_gradient_bytes

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "writing-a-comm-hook.md"
EXAMPLE = ROOT / "examples" / "comm_hook_topk.py"
#: What a rank sends per step of StackModel at ratio 0.01: per layer, ceil(1% of 256 x 256) = 656 weight values and
#: ceil(1% of 256) = 3 bias values, each an fp32 value and an int32 index.
TOPK_BYTES = LAYERS * (math.ceil(WIDTH * WIDTH / 100) + math.ceil(WIDTH / 100)) * (4 + 4)
#: Batch 2 of each epoch overflows (global steps 2 and 6), on rank 1 only: 4 steps per epoch, 2 epochs.
OVERFLOW_AT = (2,)

load_script("examples/comm_hook_topk.py")  # importable as comm_hook_topk, as from the guide reader's own directory


@pytest.fixture
def topk_registered():
    """The example's hook, registered as the guide shows, and taken out again (the registry tests list the rest)."""
    from comm_hook_topk import topk_spec

    register_comm_hook(topk_spec())
    yield
    del COMM_HOOKS["topk"]


class _HookProbe(pl.Callback):
    """Saves, per rank, the hook's committed state after every step, read as it is (nothing committed for it)."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        state = trainer.strategy.comm_state
        errors = {name: error.clone() for name, error in state.errors.items()}
        self.steps.append(
            {
                "iteration": state.iteration,
                "skipped": state.skipped_rounds,
                "errors": errors,
                "config": state.config_dict(),
            }
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.steps, self.out / f"hook{trainer.global_rank}.pt")


def _fit(out: Path, **kwargs: Any) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Two epochs of 4 steps on 2 ranks with the top-k hook, fp16 AMP with a GradScaler and an overflow on rank 1."""
    monitor = AMPMonitor()
    ranks = fit_ddp(
        out,
        OptimizedDDPStrategy(comm_hook="topk", start_method="fork"),
        model=OverflowModel(overflow_at=OVERFLOW_AT, ranks=(1,), lr=0.01),
        plugins=[fp16_mixed_precision("cpu", init_scale=2.0**10)],
        callbacks=[monitor, _HookProbe(out)],
        max_epochs=2,
        **kwargs,
    )
    return ranks, [torch.load(out / f"hook{rank}.pt") for rank in range(2)]


def _same_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.quick
def test_the_guides_hook_syncs_skips_the_overflow_and_resumes_bit_exactly(tmp_path, topk_registered):
    ranks, hooks = _fit(tmp_path / "full", save_epochs_to=tmp_path)
    for record, steps in zip(ranks, hooks, strict=True):
        assert record["comm_hook_name"] == "topk"
        # The ledger counts what the hook's format sends, every step, a fiftieth of fp32's bytes.
        assert [step["wire_bytes"] for step in record["steps"]] == [TOPK_BYTES] * 8
        assert all(step["logical_bytes"] == stack_gradient_bytes() for step in record["steps"])
        # The commit rule: the hook closes its rounds with seal_now=False, so each step's round is judged when the
        # next one opens: nothing is committed after the first step, and the overflowing rounds (the second step of
        # each epoch, on rank 1) are dropped on every rank when the following round opens: the committed errors
        # stay as they were exactly then, and change at every other step.
        assert [step["iteration"] for step in steps] == list(range(1, 9))
        assert len(steps[0]["errors"]) == 0
        assert [step["skipped"] for step in steps] == [0, 0, 1, 1, 1, 1, 2, 2]
        unchanged = [_same_errors(steps[k]["errors"], steps[k - 1]["errors"]) for k in range(1, 8)]
        assert unchanged == [False, True, False, False, False, True, False]
        assert all(bool(error.isfinite().all()) for error in steps[-1]["errors"].values())
        assert len(steps[-1]["errors"]) == 2 * LAYERS and steps[-1]["config"] == {"ratio": 0.01}
    # Every rank ends with the same parameters, and they moved.
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    assert bool(ranks[0]["params"].isfinite().all())

    # Resumed from the checkpoint of the first epoch's end: the same bits as the run that went on, hook state too.
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    assert checkpoint["ddpopt"]["comm_hook"] == "topk"
    resumed, resumed_hooks = _fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    for rank in range(2):
        torch.testing.assert_close(resumed[rank]["params"], ranks[rank]["params"], rtol=0, atol=0)
        assert [step["wire_bytes"] for step in resumed[rank]["steps"]] == [TOPK_BYTES] * 4
        for got, want in zip(resumed_hooks[rank], hooks[rank][4:], strict=True):
            assert (got["iteration"], got["skipped"]) == (want["iteration"], want["skipped"])
            assert _same_errors(got["errors"], want["errors"])


@pytest.mark.quick
def test_the_guide_shows_the_example_file_and_how_it_is_registered():
    # The guide's code blocks, in order, are examples/comm_hook_topk.py from its first import on.
    page = GUIDE.read_text()
    shown = re.findall(r"<!-- not run: examples/comm_hook_topk\.py -->\n```python\n(.*?)```", page, re.S)
    code = EXAMPLE.read_text()
    assert "\n\n".join(shown) == code[code.index("import functools") :]
    assert "register_comm_hook(topk_spec())" in page
    assert "writing-a-comm-hook.md" in (ROOT / "docs" / "guides" / "comm-hooks.md").read_text()


@pytest.mark.quick
def test_register_comm_hook_refuses_what_it_cannot_take(topk_registered):
    from comm_hook_topk import topk_spec

    with pytest.raises(ValueError, match=r"spec.name='topk' is registered already"):
        register_comm_hook(topk_spec())
    with pytest.raises(ValueError, match=r"spec.name='auto' must be"):
        register_comm_hook(topk_spec(name="auto"))
    with pytest.raises(TypeError, match=r"spec='topk'\): spec must be a HookSpec"):
        register_comm_hook("topk")  # type: ignore[arg-type]
    assert sorted(COMM_HOOKS).count("topk") == 1


@pytest.mark.slow
def test_the_guides_hook_on_three_ranks_with_fabric(tmp_path, topk_registered):
    from tests.test_fabric import Run, assert_ranks_identical, launch

    ranks = launch(Run(str(tmp_path), hook="topk", callbacks=[]), devices=3)
    assert_ranks_identical(ranks)
    sizes = [p.numel() for p in ranks[0]["params"]]
    sent = sum(8 * max(1, math.ceil(size / 100)) for size in sizes)
    for rank in ranks:
        assert rank["hook"] == "topk" and rank["state"] == "TopKState"
        assert {step["wire"] for step in rank["steps"]} == {sent}


@pytest.mark.quick
def test_the_diagnosis_reports_a_users_hooks_error_without_judging_it_by_the_casts_limit():
    from lightning_ddpopt.diagnosis import diagnose

    findings = {f.area: f for f in diagnose({"comm_hook": "topk", "comm": {"compression_error": 0.5}})}
    assert findings["compression"].status == "unknown"
    assert "relative compression error 0.500" in findings["compression"].evidence
    assert "no quality limit is known for this hook" in findings["compression"].evidence
    # The built-in casts keep theirs.
    findings = {f.area: f for f in diagnose({"comm_hook": "fp16", "comm": {"compression_error": 0.5}})}
    assert findings["compression"].status == "problem"
