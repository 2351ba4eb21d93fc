"""Local SGD islands on emulated nodes: ``python -m tests.islands_worker OUT_DIR``, started once per "node" by
tests/test_islands.py with ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set as a cluster launcher sets them;
Lightning starts the node's other ranks. Every rank writes what it saw of each fit to ``OUT_DIR/<fit>_rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddpopt import (
    AMPMonitor,
    CommProfiler,
    LocalSGDConfig,
    OptimizedDDPStrategy,
    StragglerDetector,
    fp16_mixed_precision,
)
from tests.helpers import OverflowModel, regression_data

RANKS_PER_NODE = int(os.environ.get("DDPOPT_TEST_RANKS_PER_NODE", "2"))
NUM_NODES = int(os.environ.get("DDPOPT_TEST_NODES", "2"))
#: The fits: name -> the local SGD config. Every fit runs 8 optimizer steps (the resumed ones two epochs of 4), but
#: "auto" 24.
FITS: dict[str, LocalSGDConfig] = {
    # Node islands by "auto"; syncs at 3 and 6, the final average at 8; fp16 AMP with one rank's overflow at step 2
    # and the measuring callbacks attached.
    "diloco": LocalSGDConfig.diloco(sync_every=3, compression="fp32"),
    # int8 across the islands, travelling 2 steps; mixing 0: every rank takes the new anchor when it arrives.
    "int8_overlap": LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, overlap_mixing=0.0, compression="int8"),
    # Two synchronous steps through the strategy's hook (two-tier int8 at N x M), then islands; syncs at 5 and 8.
    "warmup": LocalSGDConfig.post_local_sgd(sync_every=3, warmup_steps=2),
    # Saved at the end of the first epoch (a sync, step 4), resumed from there: Adam's state per island.
    "resume_full": LocalSGDConfig.diloco(sync_every=4, replica="node"),
    "resume_half": LocalSGDConfig.diloco(sync_every=4, replica="node"),
    # Saved as islands (the outer state as the first island's slices), resumed with a replica per rank: every rank
    # reads the whole anchor from the slices, and takes its saved island's Adam state.
    "islands_to_ranks": LocalSGDConfig.diloco(sync_every=4, replica="rank"),
    # Saved with a replica per rank (each rank's own Adam state), resumed as islands: an island's ranks take its
    # first rank's state, and stay identical.
    "ranks_save": LocalSGDConfig.diloco(sync_every=4, replica="rank"),
    "ranks_to_islands": LocalSGDConfig.diloco(sync_every=4, replica="node"),
    # Saved while an fp16 sync travels across the islands (started at step 4, applied at 6), resumed from there: the
    # uninterrupted run's next anchor is computed and gathered ahead on the worker, the resumed run's at the apply.
    "overlap_full": LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, overlap_mixing=0.0),
    "overlap_half": LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, overlap_mixing=0.0),
    # H chosen by the islands (24 steps): the provisional sync starts at 16, is applied at 18 and measured; its
    # agreement runs across the islands' groups, and every rank takes the same H from then on.
    "auto": LocalSGDConfig.diloco("auto", overlap_steps=2, overlap_mixing=0.0),
}
CHOSEN = os.environ.get("DDPOPT_TEST_FITS", ",".join(FITS)).split(",")
#: In the "diloco" fit, this rank's loss overflows at its second step: its island skips that step, the others not.
OVERFLOW_RANK = RANKS_PER_NODE + 1


class Counting(OverflowModel):
    """Counts its steps, each rank by its rank + 1, in a float buffer: the outer sync averages it over every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.seen += self.global_rank + 1
        return super().training_step(batch, batch_idx)


class Probe(pl.Callback):
    """The parameters before each sync and after every step, the outer state's sizes, the ledger, the callbacks."""

    def __init__(self, out: Path, fit: str) -> None:
        self.out, self.fit = out, fit
        self.before_sync: dict[int, torch.Tensor] = {}
        self.params: list[torch.Tensor] = []
        self.start: torch.Tensor | None = None
        self.shard: tuple[int, int] | None = None
        self.sizes: dict[str, Any] = {}
        self.anchor_at_start: torch.Tensor | None = None
        self.first_batch: list[torch.Tensor] | None = None
        self.buffers: list[list[float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = _flat(pl_module)
        strategy = trainer.strategy
        assert isinstance(strategy, OptimizedDDPStrategy) and strategy.local_sgd is not None
        anchor = strategy.local_sgd.anchor  # restored from a checkpoint, or None before the first local batch
        self.anchor_at_start = None if anchor is None else anchor.clone()

        def before_the_sync(*_: Any) -> None:  # after the inner step, before the strategy's outer step
            loop = strategy.local_sgd
            if loop is not None and loop.local and loop.next_step_meets:
                self.before_sync[trainer.global_step + 1] = _flat(pl_module)

        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(before_the_sync)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if self.first_batch is None:
            self.first_batch = [tensor.clone() for tensor in batch]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.params.append(_flat(pl_module))
        self.buffers.append([buffer.item() for buffer in pl_module.buffers()])
        loop = trainer.strategy.local_sgd  # type: ignore[attr-defined]
        self.shard = loop.layout.bounds  # while training: after fit each rank holds the whole outer state
        self.sizes = {
            "anchor": loop.anchor.numel() if loop.anchor is not None else None,
            "momentum": loop.momentum.numel() if loop.momentum is not None else None,
            "work": loop._work.numel() if loop._work is not None else None,
            "int8": [tuple(t.shape) for t in loop._int8._rows] if loop._int8 and loop._int8._rows else None,
            "full": loop.layout._full.numel() if loop.layout._full is not None else None,
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, OptimizedDDPStrategy) and strategy.ledger is not None
        loop, ledger = strategy.local_sgd, strategy.ledger
        assert loop is not None
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "start": self.start,
            "params": self.params,
            "final": _flat(pl_module),  # after the strategy's final average
            "anchor_at_start": self.anchor_at_start,
            "first_batch": self.first_batch,
            "buffers": self.buffers,
            "before_sync": self.before_sync,
            "shard": self.shard,
            "sizes": self.sizes,
            "anchor": loop.anchor.clone() if loop.anchor is not None else None,  # whole again after fit
            "syncs": loop.syncs,
            "skipped_inner": loop.skipped_inner_steps,
            "sync_every_choice": loop.sync_every_choice,
            "steps": [(s.sync_rounds, s.logical_bytes, s.wire_bytes, s.intra_node_bytes) for s in ledger.steps],
        }
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, StragglerDetector):
                record["stragglers"] = callback.summary()
            if isinstance(callback, CommProfiler):
                record["comm"] = dict(callback.last_metrics)
            if isinstance(callback, AMPMonitor):
                record["amp"] = callback.summary()
        torch.save(record, self.out / f"{self.fit}_rank{trainer.global_rank}.pt")


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).cpu().clone()


def fit(out: Path, name: str) -> pl.Trainer:
    resume = {"resume_full": "full", "resume_half": "half", "ranks_save": "full", "ranks_to_islands": "half"}.get(name)
    resume = "half" if name == "islands_to_ranks" else resume
    resume = {"overlap_full": "full", "overlap_half": "half"}.get(name, resume)
    folder = out / ("ranks" if name.startswith("ranks") else "overlap" if name.startswith("overlap") else "resume")
    callbacks: list[pl.Callback] = [Probe(out, name)]
    plugins = None
    model = OverflowModel()
    if name == "diloco":
        callbacks += [CommProfiler(every_n_steps=4, report=False), StragglerDetector(every_n_steps=4), AMPMonitor()]
        plugins = [fp16_mixed_precision("cpu", init_scale=256.0)]
        model = OverflowModel(overflow_at=(2,), ranks=(OVERFLOW_RANK,))
    if name == "int8_overlap":
        model = Counting()
    if resume is not None:
        if not name.startswith("overlap"):
            model.optimizer_name = "adam"
        if resume == "full":
            callbacks.append(ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=RANKS_PER_NODE,
        num_nodes=NUM_NODES,
        strategy=OptimizedDDPStrategy(
            local_sgd=FITS[name], bucket_cap_mb=0.5, comm_hook="int8" if name == "warmup" else "allreduce"
        ),
        max_epochs=6 if name == "auto" else 2,  # 24 steps, else 8
        logger=False,
        enable_checkpointing=resume == "full",
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / name,
        callbacks=callbacks,
        plugins=plugins,
    )
    pl.seed_everything(0)
    loader = DataLoader(regression_data(8 * 4 * NUM_NODES * RANKS_PER_NODE), batch_size=8)
    trainer.fit(model, loader, ckpt_path=str(folder / "epoch=0.ckpt") if resume == "half" else None)
    return trainer


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in FITS:
        if name in CHOSEN:
            last = fit(out, name)
    (out / f"done_rank{last.global_rank}").write_text("ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
