"""Fits on emulated nodes: ``python -m tests.nodes_worker OUT_DIR``, started once per "node" by
tests/test_hierarchical.py with ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set as a cluster launcher sets them;
Lightning starts the node's other ranks (``RANKS_PER_NODE`` in all). Every rank writes what it saw of each fit to
``OUT_DIR/<fit>_rank<r>.pt``. ``python -m tests.nodes_worker OUT_DIR fabric``: a Fabric loop instead, each node's
ranks spawned by Fabric (``OUT_DIR/rank<r>.pt``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector, fp16_mixed_precision
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import WIDTH, OverflowModel, regression_data

RANKS_PER_NODE = int(os.environ.get("DDPOPT_TEST_RANKS_PER_NODE", "2"))
#: "cpu" (gloo), or "gpu" (NCCL: each node's process sees its own GPUs through CUDA_VISIBLE_DEVICES).
ACCELERATOR = os.environ.get("DDPOPT_TEST_ACCELERATOR", "cpu")
NUM_NODES = int(os.environ.get("DDPOPT_TEST_NODES", "2"))
#: The fits, in order: name -> (comm_hook, hierarchical). The first is the flat fp32 reference.
FITS: dict[str, tuple[str, bool | str]] = {
    "flat_allreduce": ("allreduce", False),
    "allreduce": ("allreduce", True),
    "fp16": ("fp16", "auto"),  # the default: two tiers on gloo at N x M
    "bf16": ("bf16", True),
    "flat_fp16": ("fp16", False),
    "int8": ("int8", "auto"),
    "flat_int8": ("int8", False),
    "powersgd": ("powersgd", True),  # "auto" keeps PowerSGD flat on gloo
    "flat_powersgd": ("powersgd", "auto"),
    # On NCCL "auto" keeps NCCL's own sync: True asks for the two tiers.
    "int8_tiers": ("int8", True),
    "fp16_tiers": ("fp16", True),
}
#: The fits this run makes (all of FITS by default), and whether the callbacks' fits follow them: "callbacks" with
#: TIERED_HOOK, "callbacks_<hook>" with that hook.
CHOSEN = os.environ.get("DDPOPT_TEST_FITS", ",".join([*FITS, "callbacks"])).split(",")
#: The hook of the resumed fits and of the callbacks' fit (fp16 AMP with an overflow), two tiers by default.
TIERED_HOOK = os.environ.get("DDPOPT_TEST_TIERED_HOOK", "fp16")
#: What the strategy is given for a hook name, where that is not the name itself: PowerSGD compressing from sync 2.
HOOKS: dict[str, Any] = {"powersgd": PowerSGDConfig(rank=2, start_iter=2)}
#: The ``hierarchical`` of the resumed and callbacks' fits with a hook, where not "auto".
TIERED: dict[str, bool | str] = {"powersgd": True}
#: The rank that sleeps in each training step of the callbacks' fit: local rank 1 of node 1.
#: With DDPOPT_TEST_RANK_ZERO set, rank 0 is the slow rank and the overflowing one.
RANK_ZERO = bool(os.environ.get("DDPOPT_TEST_RANK_ZERO"))
SLOW_RANK = 0 if RANK_ZERO else RANKS_PER_NODE + 1
#: Long enough that six ranks sharing two cores still show most of it above the others' median.
SLOW_MS = 150
#: In the callbacks' fit (fp16 AMP), this rank's loss overflows at this optimizer step: every rank must skip it.
OVERFLOW_RANK, OVERFLOW_STEP = 0 if RANK_ZERO else RANKS_PER_NODE, 3


class SlowLocalRank(OverflowModel):
    """With ``slow``: rank ``SLOW_RANK`` sleeps in each training step, rank ``OVERFLOW_RANK``'s loss overflows once."""

    def __init__(self, slow: bool) -> None:
        super().__init__(overflow_at=(OVERFLOW_STEP,) if slow else (), ranks=(OVERFLOW_RANK,))
        self.slow = slow
        # 3 x 256 + 3 gradients: a bucket whose size the node's ranks do not divide, padded by the two-tier sync.
        self.head = torch.nn.Linear(WIDTH, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.slow and self.global_rank == SLOW_RANK:
            time.sleep(SLOW_MS / 1e3)
        return super().training_step(batch, batch_idx) + self.head(batch[0]).square().mean()


class Probe(pl.Callback):
    def __init__(self, out: Path, fit: str) -> None:
        self.out, self.fit = out, fit

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, OptimizedDDPStrategy) and strategy.ledger is not None
        topology = strategy._core.topology
        record: dict[str, Any] = {
            "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]).cpu(),
            "rank": (trainer.global_rank, trainer.node_rank, trainer.local_rank, trainer.world_size),
            "nodes": topology.nodes if topology is not None else None,
            "state": type(strategy.comm_state).__name__,
            "hook": strategy.comm_hook_name,
            "numels": [p.numel() for p in pl_module.parameters()],
            "shapes": [tuple(p.shape) for p in pl_module.parameters()],
            "owners": getattr(strategy.comm_state, "owners", None),  # two-tier PowerSGD's parameter owners
            # DDP's buckets as they stand (rebuilt after the first step): the parameters' indices in each.
            "buckets": _bucket_members(strategy, pl_module),
            "steps": [
                (s.logical_bytes, s.wire_bytes, s.intra_node_bytes, s.bucket_bytes) for s in strategy.ledger.steps
            ],
            "tier_seconds": [(s.intra_node_s, s.cross_node_s) for s in strategy.ledger.steps],
        }
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, StragglerDetector):
                record["stragglers"] = callback.summary()
            if isinstance(callback, CommProfiler):
                record["comm"] = dict(callback.last_metrics)
            if isinstance(callback, AMPMonitor):
                record["amp"] = callback.summary()
        torch.save(record, self.out / f"{self.fit}_rank{trainer.global_rank}.pt")


def _bucket_members(strategy: OptimizedDDPStrategy, module: pl.LightningModule) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(module.parameters())}
    model = strategy.model
    assert model is not None
    buckets = model.reducer._get_zeros_like_grad_buckets()  # type: ignore[union-attr, operator]
    return [sorted(index[id(p)] for p in bucket.parameters()) for bucket in buckets]


def fit(
    out: Path,
    name: str,
    hook: str,
    hierarchical: bool | str,
    callbacks: list[pl.Callback] | None = None,
    resume: str | None = None,
) -> pl.Trainer:
    """8 optimizer steps; with ``resume``, two epochs of 4: ``"save"`` saving at each epoch's end, ``"load"`` resumed
    from the first epoch's checkpoint."""
    epochs: dict[str, Any] = {"max_steps": 8}
    if resume is not None:
        epochs = {"max_epochs": 2}
        saving = ModelCheckpoint(dirpath=out / "resume", filename="{epoch}", save_top_k=-1)
        callbacks = [saving] if resume == "save" else []
    trainer = pl.Trainer(
        accelerator=ACCELERATOR,
        devices=RANKS_PER_NODE,
        num_nodes=NUM_NODES,
        strategy=OptimizedDDPStrategy(comm_hook=HOOKS.get(hook, hook), hierarchical=hierarchical, bucket_cap_mb=0.5),
        **epochs,
        logger=False,
        enable_checkpointing=resume == "save",
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / name,
        callbacks=[*(callbacks or []), Probe(out, name)],
        plugins=[fp16_mixed_precision("cpu", init_scale=256.0)] if callbacks and not resume else None,  # one overflow
    )
    pl.seed_everything(0)
    model = SlowLocalRank(slow=bool(callbacks) and not resume)
    steps = 4 if resume else 8
    loader = DataLoader(regression_data(8 * steps * NUM_NODES * RANKS_PER_NODE), batch_size=8)
    trainer.fit(model, loader, ckpt_path=str(out / "resume" / "epoch=0.ckpt") if resume == "load" else None)
    return trainer


def callbacks_hook(name: str) -> str:
    """The hook of a callbacks' fit: ``"callbacks_<hook>"``'s, else ``TIERED_HOOK``."""
    return name.partition("_")[2] or TIERED_HOOK


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (hook, hierarchical) in FITS.items():
        if name in CHOSEN:
            last = fit(out, name, hook, hierarchical)
    if "resume" in CHOSEN:  # two tiers through a checkpoint: the resumed run ends as the uninterrupted one
        fit(out, "resume_full", TIERED_HOOK, TIERED.get(TIERED_HOOK, "auto"), resume="save")
        last = fit(out, "resume_half", TIERED_HOOK, TIERED.get(TIERED_HOOK, "auto"), resume="load")
    for name in CHOSEN:
        if name.startswith("callbacks"):
            measured = [CommProfiler(every_n_steps=4, report=False), StragglerDetector(every_n_steps=4), AMPMonitor()]
            hook = callbacks_hook(name)
            last = fit(out, name, hook, TIERED.get(hook, "auto"), callbacks=measured)
    (out / f"done_rank{last.global_rank}").write_text("ok")


def fabric_main(out: Path) -> None:
    """A Fabric loop (tests/test_fabric.py's) on this node, its ranks started by Fabric's ``spawn`` launcher: two-tier
    int8 under fp16 AMP, rank 1's loss overflowing at step 3, every measuring callback through the Monitor."""
    from tests.test_fabric import Run, launch

    out.mkdir(parents=True, exist_ok=True)
    run = Run(str(out), hook="int8", fp16=True, overflow_step=3, start_method="spawn")
    for record in launch(run, devices=RANKS_PER_NODE, num_nodes=NUM_NODES):
        (out / f"done_rank{record['rank'][0]}").write_text("ok")


if __name__ == "__main__":
    if sys.argv[2:] == ["fabric"]:
        fabric_main(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
