"""One rank of an emulated-cluster benchmark run: a Lightning Trainer with ``num_nodes=N, devices=M``.

Started by ``benchmarks/cluster.py`` once per rank of each emulated host (inside that host's network namespace);
reads the rendezvous from MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE. Global rank 0 prints one line
``RESULT {json}`` with the per-step times and the ledger's sync figures (``--task throughput``), or with the
held-out accuracy after each epoch against the training wall time (``--task digits``: the example's digits
classifier).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import AMPMonitor, CommProfiler, LocalSGDConfig, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.hooks import PowerSGDConfig


def _fp16_tiers_inline() -> OptimizedDDPStrategy:
    """fp16 in two tiers with each bucket's three stages run in the hook call: what the CPU's stage threads buy."""
    from lightning_ddpopt.hooks import _worker

    def run(self: Any, state: Any, sync: Any, index: int) -> torch.futures.Future[torch.Tensor]:
        sync.reduce_inside()
        sync.reduce_between()
        sync.gather()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(sync.buffer)
        return future

    _worker.TierStages.run = run  # type: ignore[method-assign]
    return OptimizedDDPStrategy(comm_hook="fp16", hierarchical=True)


def _powersgd_inline(**config: Any) -> OptimizedDDPStrategy:
    """PowerSGD with each bucket's chain run in the hook call (``pipelined`` kept off): what its worker thread buys."""
    from lightning_ddpopt.hooks import powersgd

    setattr_ = powersgd.PowerSGDState.__setattr__

    def keep_inline(self: Any, name: str, value: Any) -> None:
        setattr_(self, name, False if name == "pipelined" else value)

    powersgd.PowerSGDState.__setattr__ = keep_inline  # type: ignore[method-assign]
    return _powersgd(**config)


def _powersgd(hierarchical: bool = False, **config: Any) -> OptimizedDDPStrategy:
    """PowerSGD compressing from sync 2; flat (every rank in one ring) unless ``hierarchical``."""
    return OptimizedDDPStrategy(comm_hook=PowerSGDConfig(start_iter=2, **config), hierarchical=hierarchical)


#: variant -> (strategy factory, accumulate_grad_batches)
VARIANTS: dict[str, tuple[Any, int]] = {
    "stock": (lambda: DDPStrategy(), 1),
    "ours": (lambda: OptimizedDDPStrategy(), 1),
    "ours_builtin": (lambda: OptimizedDDPStrategy(comm_hook=None), 1),
    "ours_no_view": (lambda: OptimizedDDPStrategy(gradient_as_bucket_view=False), 1),
    # Flat: every rank in one ring over the hosts' links; *_hier: summed inside the host, 1/M of it sent between hosts.
    "fp16": (lambda: OptimizedDDPStrategy(comm_hook="fp16", hierarchical=False), 1),
    "bf16": (lambda: OptimizedDDPStrategy(comm_hook="bf16", hierarchical=False), 1),
    "ours_flat": (lambda: OptimizedDDPStrategy(hierarchical=False), 1),
    "allreduce_hier": (lambda: OptimizedDDPStrategy(hierarchical=True), 1),
    "fp16_hier": (lambda: OptimizedDDPStrategy(comm_hook="fp16", hierarchical=True), 1),
    "fp16_hier_inline": (_fp16_tiers_inline, 1),
    "bf16_hier": (lambda: OptimizedDDPStrategy(comm_hook="bf16", hierarchical=True), 1),
    "int8": (lambda: OptimizedDDPStrategy(comm_hook="int8", hierarchical=False), 1),
    "int8_hier": (lambda: OptimizedDDPStrategy(comm_hook="int8", hierarchical=True), 1),
    # A fixed rank (max_error=None); "powersgd" is the default: rank 4 raised while the error is above its bound
    # (0.9 with this MLP's SGD, 0.6 with the transformer's AdamW).
    "powersgd_r1": (lambda: _powersgd(rank=1, max_error=None), 1),
    "powersgd_r4": (lambda: _powersgd(rank=4, max_error=None), 1),
    "powersgd_r4_inline": (lambda: _powersgd_inline(rank=4, max_error=None), 1),
    "powersgd_r4_hier": (lambda: _powersgd(True, rank=4, max_error=None), 1),
    "powersgd": (lambda: _powersgd(), 1),
    "powersgd_hier": (lambda: _powersgd(True), 1),
    "accum4": (lambda: OptimizedDDPStrategy(), 4),
    "diloco16": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16)), 1),
    "diloco16_int8": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, compression="int8")), 1),
    "diloco32": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(32)), 1),
    "diloco16_overlap": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, overlap_steps=8)), 1),
    # fp16 changes travelling 12 of the 16 steps: room for the wire time of a sync (2 bytes a parameter each way).
    "diloco16_overlap12": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, overlap_steps=12)), 1),
    "diloco16_int8_overlap": (
        lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, overlap_steps=8, compression="int8")),
        1,
    ),
    # Each rank a replica, against the default's replica per host (at --ranks-per-host above 1).
    "diloco16_ranks": (lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, replica="rank")), 1),
    "diloco16_overlap_ranks": (
        lambda: OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, overlap_steps=8, replica="rank")),
        1,
    ),
    "compute": (lambda: "auto", 1),
    # Each host alone, its ranks in DDP over the host's own link (started as one job per host): the islands' limit.
    "islands_alone": (lambda: OptimizedDDPStrategy(), 1),
    "auto_hook": (lambda: OptimizedDDPStrategy(comm_hook="auto"), 1),
    **{f"cap{cap}": (lambda cap=cap: OptimizedDDPStrategy(bucket_cap_mb=cap), 1) for cap in (1, 5, 25, 100, 200)},
}


class MLP(pl.LightningModule):
    """``layers`` Linear(width, width) layers: (width^2 + width) x layers parameters."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    """Wall time of every optimizer step, measured at the end of the batch that stepped."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.hook_marks: list[tuple[float, float]] = []  # the comm hook's cumulative host and wait seconds
        self._last: float | None = None
        self._seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._seen:
            return
        self._seen = trainer.global_step
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now
        state = getattr(trainer.strategy, "comm_state", None)
        if state is not None and hasattr(state, "hook_seconds"):
            self.hook_marks.append((state.hook_seconds, state.wait_seconds))

    def hook_breakdown(self, warmup: int) -> dict[str, float] | None:
        """Per timed step: seconds inside hooks that block (PowerSGD, int8), and of them waiting for the network."""
        marks = self.hook_marks[max(warmup - 1, 0) :]
        if len(marks) < 2 or marks[-1][0] == marks[0][0]:
            return None
        steps = len(marks) - 1
        inside, waiting = (marks[-1][i] - marks[0][i] for i in (0, 1))
        return {"hook_s": inside / steps, "hook_wait_s": waiting / steps, "hook_work_s": (inside - waiting) / steps}


class AccuracyCurve(pl.Callback):
    """Rank 0: held-out accuracy after every epoch against training wall time (evaluation time left out)."""

    def __init__(self, test: TensorDataset) -> None:
        self.test = test
        self.curve: list[tuple[float, float]] = []
        self._start = 0.0
        self._evaluating = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        started = time.perf_counter()
        x, y = self.test.tensors
        with torch.no_grad():
            accuracy = (pl_module(x).argmax(dim=1) == y).float().mean().item()
        self.curve.append((started - self._start - self._evaluating, accuracy))
        self._evaluating += time.perf_counter() - started


def _quiet_trainer(
    num_nodes: int, strategy: Any, callbacks: list[pl.Callback], devices: int = 1, **settings: Any
) -> pl.Trainer:
    """``devices`` processes per emulated host on the CPU; no logger, checkpoints, progress bar or summary."""
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **settings,
    )


def run_digits(args: argparse.Namespace, make_strategy: Any) -> None:
    """Train the example's digits classifier for ``args.epochs``; rank 0 prints the accuracy curve."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_digits import DigitsClassifier, digits_split

    train, test = digits_split()
    curve = AccuracyCurve(test)
    pl.seed_everything(0, verbose=False)
    trainer = _quiet_trainer(args.num_nodes, make_strategy(), [curve], max_epochs=args.epochs)
    trainer.fit(DigitsClassifier(), DataLoader(train, batch_size=args.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        result = {"variant": args.variant, "world_size": trainer.world_size, "curve": curve.curve}
        print("RESULT " + json.dumps(result), flush=True)


def _throughput_model(args: argparse.Namespace) -> pl.LightningModule:
    """The MLP, or the byte-level GPT of ``benchmarks/transformer_quality.py`` (AdamW) at ``--width``/``--layers``."""
    if args.model == "transformer":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from transformer_quality import TinyGPT

        return TinyGPT(width=args.width, layers=args.layers, heads=max(1, args.width // 64))
    return MLP(args.width, args.layers)


def _throughput_data(args: argparse.Namespace, samples: int) -> TensorDataset:
    """Random regression pairs for the MLP; random byte windows (input, next bytes) for the GPT."""
    generator = torch.Generator().manual_seed(0)
    if args.model == "transformer":
        from transformer_quality import CONTEXT

        tokens = torch.randint(0, 256, (samples, CONTEXT + 1), generator=generator)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return TensorDataset(
        torch.randn(samples, args.width, generator=generator), torch.randn(samples, args.width, generator=generator)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1, help="ranks per host (each started by cluster.py)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps not timed (DDP's bucket rebuild, warm-up)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--task", choices=("throughput", "digits"), default="throughput")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--epochs", type=int, default=10, help="--task digits: epochs to train")
    parser.add_argument(
        "--callbacks", action="store_true", help="attach CommProfiler, StragglerDetector and AMPMonitor (defaults)"
    )
    parser.add_argument("--nonfinite-check", choices=("on", "off"), default="on", help="AMPMonitor's check_nonfinite")
    args = parser.parse_args()
    threads = os.environ.get("DDPOPT_BENCH_THREADS", "1")
    # Lightning's DDP sets torch's threads to cores / local processes unless OMP_NUM_THREADS says otherwise, which
    # would give every emulated host all of the machine's cores.
    os.environ["OMP_NUM_THREADS"] = threads
    torch.set_num_threads(int(threads))

    make_strategy, accumulate = VARIANTS[args.variant]
    if args.task == "digits":
        run_digits(args, make_strategy)
        return
    num_nodes = 1 if args.variant == "compute" else args.num_nodes
    devices = 1 if args.variant == "compute" else args.devices
    model = _throughput_model(args)
    if args.variant == "auto_hook":
        # auto may choose PowerSGD, which compresses from its start_iter on: time only compressed steps.
        start_iter = PowerSGDConfig().start_iter
        args.steps, args.warmup = args.steps + start_iter, args.warmup + start_iter
    if args.variant.startswith("diloco") or args.variant in ("compute", "islands_alone"):
        # Two to four whole sync windows timed; as many compute steps, whose mean local SGD is compared with.
        args.steps = args.warmup + 64
    data = _throughput_data(args, (args.steps + 1) * accumulate * args.batch_size * num_nodes * devices)
    timer = StepTimer()
    amp = AMPMonitor(check_nonfinite=args.nonfinite_check == "on")
    measuring: list[pl.Callback] = [CommProfiler(), StragglerDetector(), amp] if args.callbacks else []
    pl.seed_everything(0, verbose=False)
    trainer = _quiet_trainer(
        num_nodes,
        make_strategy(),
        [timer, *measuring],
        devices=devices,
        max_steps=args.steps,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    if trainer.global_rank != 0:
        return
    timed = timer.times[max(args.warmup - 1, 0) :]
    ledger = getattr(trainer.strategy, "ledger", None)
    steps = list(ledger.steps)[args.warmup :] if ledger is not None else []
    synced = [s for s in steps if s.sync_rounds]
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    result = {
        "variant": args.variant,
        "world_size": trainer.world_size,
        "samples_per_step": args.batch_size * accumulate * trainer.world_size,
        "step_times_s": timed,
        "gradient_bytes": sum(p.numel() * 4 for p in trainer.lightning_module.parameters()),
        # Local SGD syncs once every H steps: its sync time is the median over the steps that synced.
        "sync_time_s": statistics.median(s.sync_time_s for s in synced) if synced else None,
        "bytes_sent": statistics.fmean(s.wire_bytes or 0 for s in steps) if steps else None,
        "bytes_sent_intra_node": statistics.fmean(s.intra_node_bytes for s in steps) if steps else None,
        "sync_rounds": statistics.mean(s.sync_rounds for s in steps) if steps else None,
        "bucket_cap_mb": getattr(getattr(trainer.strategy, "bucket_plan", None), "cap_mb", None),
        "comm_hook": f"local SGD H={local_sgd.config.sync_every}"
        + (f" tau={local_sgd.config.overlap_steps}" if local_sgd.config.overlap_steps else "")
        if local_sgd is not None
        else getattr(trainer.strategy, "comm_hook_name", None),
        "hook_breakdown": timer.hook_breakdown(args.warmup),
    }
    if local_sgd is not None:
        # What each timed step did (timed step i is optimizer step warmup + 1 + i), for where the time goes.
        config = local_sgd.config
        first = max(args.warmup - 1, 0) + 2
        result["sync_phases"] = [
            sync_phase(first + i, config.sync_every, config.overlap_steps, config.warmup_steps)
            for i in range(len(timed))
        ]
    print("RESULT " + json.dumps(result), flush=True)


def sync_phase(step: int, sync_every: int, overlap_steps: int, warmup_steps: int) -> str:
    """What local SGD's optimizer step ``step`` (1-based) did: ``"sync"`` (a blocking one), ``"start"`` and
    ``"apply"`` (an overlapped one's), ``"travelling"`` (while one travels), ``"alone"`` (nothing) or ``"warmup"``."""
    if step <= warmup_steps:
        return "warmup"
    into = (step - warmup_steps) % sync_every
    if into == 0:
        return "start" if overlap_steps else "sync"
    if overlap_steps and into == overlap_steps and step - warmup_steps > sync_every:
        return "apply"
    if overlap_steps and into < overlap_steps and step - warmup_steps > sync_every:
        return "travelling"
    return "alone"


if __name__ == "__main__":
    main()
