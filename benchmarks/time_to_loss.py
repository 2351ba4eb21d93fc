"""Time to stock's loss: how much sooner each option reaches the validation loss stock ``DDPStrategy`` reaches.

Emulated hosts on a shaped link (``benchmarks/cluster.py``'s network namespaces: one per host, ``--ranks-per-host``
ranks in each, the hosts' links shaped with ``tc ... tbf rate RATE``). Every rank runs this same script with the same
seed; Lightning's distributed sampler shards the data. Two models, both on real data shipped with Python or a
package:

* ``gpt``: the byte-level GPT of ``benchmarks/transformer_quality.py`` (2 x width 128, context 64, AdamW 3e-3) on
  Python's pydoc topics, 90% for training and 10% held out;
* ``mlp``: a wide MLP (64 -> 3 x 1024 -> 10, SGD with Nesterov momentum) on scikit-learn's 8x8 digits, a fifth held out:
  the comm-bound regime (a large gradient for little compute).

Stock runs ``--steps`` optimizer steps: the validation loss at its last step is the **target**, its training wall
time the **budget**. Every other option trains until it has reached the target and used the budget, or for
``--cap`` budgets: its **time to the target** (linear between evaluations) and its **loss at the budget** are
reported. The validation loss is measured on every rank at once every ``--eval-every`` steps (local SGD: right after
each averaging, when a replica holds what the sync made) on a fixed held-out set, and that time is left out of the
clock. Rounds are interleaved (every option once, then again) and each figure is the median over the rounds of its
ratio to the same round's stock.

    .venv/bin/python benchmarks/time_to_loss.py                            # 2 hosts x 1 rank, 50 Mbit, GPT
    .venv/bin/python benchmarks/time_to_loss.py --ranks-per-host 2         # 2 x 2
    .venv/bin/python benchmarks/time_to_loss.py --model mlp --rate 200mbit
    .venv/bin/python benchmarks/time_to_loss.py --variants stock,diloco16,diloco16_lr1.0 --name sweep
    .venv/bin/python benchmarks/time_to_loss.py --suite                    # the README's 2 x 1 columns (SUITE)

Variants: ``stock``, ``compute`` (the compute-only limit: stock's steps on every rank alone, no process group, all at
once; its time over an option's time to the target is the option's "of the limit"), ``ours``
(``OptimizedDDPStrategy()``), a hook's name (``fp16``, ``bf16``, ``int8``, ``powersgd``) flat, ``<hook>_hier`` in
two tiers, ``diloco<H>[_overlap[<tau>]][_int8|_fp32][_ranks|_replica<k>]
[_lr<outer lr>][_m<outer momentum>][_a<overlap mixing>][_w<warm-up steps>]`` (``transformer_quality.diloco_config``:
islands of a host's ranks unless ``_ranks``; ``diloco()``'s settings otherwise); ``dilocoauto``
(``sync_every="auto"``) is measured after each sync, of the provisional H first, then of the H it chose (the choice
and its figures are in the results).
Writes ``benchmarks/results/<name>.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# The package beside this script first (a snapshot of the tree can be benchmarked while the tree changes).
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from cluster import Cluster, can_emulate, parse_rate, run_variant  # noqa: E402

GPT_VARIANTS = (
    "stock",
    "compute",
    "ours",
    "fp16",
    "bf16",
    "int8",
    "powersgd",
    "diloco16",
    "diloco16_int8",
    "diloco16_overlap8",
)
#: ``--suite``: the README table's columns of 2 hosts x 1 rank, each a layout of its own (about 30 minutes for the
#: two on 2 cores): the compute-only limit and the options the README recommends, on the GPT at a rate where stock's
#: sync is most of its step and on the MLP at 200 Mbit. It sets each layout's ``--model``, ``--rate``, ``--variants``
#: and ``--name``.
SUITE: tuple[dict[str, Any], ...] = (
    {"model": "gpt", "rate": "50mbit", "variants": "stock,compute,ours,fp16,int8,powersgd,diloco16,diloco16_overlap8"},
    {
        "model": "mlp",
        "rate": "200mbit",
        "eval_every": 4,
        "variants": "stock,compute,int8,powersgd,diloco16,diloco16_overlap8",
    },
)
#: At --ranks-per-host above 1 the two-tier hooks and the replica per rank join (DiLoCo's islands are the default).
TIERED_VARIANTS = ("int8_hier", "diloco16_ranks")
HELD_OUT = 256  # held-out windows (GPT) evaluated at every measuring step


def _diloco(variant: str) -> Any:
    from transformer_quality import diloco_config

    return diloco_config(variant)


def make_strategy(variant: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddpopt import OptimizedDDPStrategy

    if variant == "stock":
        return DDPStrategy()
    if variant == "compute":  # every rank alone: no process group, no sync
        return "auto"
    if variant == "ours":
        return OptimizedDDPStrategy()
    if variant.startswith("diloco"):
        return OptimizedDDPStrategy(local_sgd=_diloco(variant))
    hook = variant.removesuffix("_hier")
    return OptimizedDDPStrategy(comm_hook=hook, hierarchical=hook != variant)


# ---------------------------------------------------------------------------------------------------- the worker


def _gpt_data() -> tuple[Any, Any, Any, Any]:
    from transformer_quality import CONTEXT, TinyGPT, text_bytes, windows

    data = text_bytes()
    split = int(0.9 * data.numel())
    held_out = windows(data[split:], stride=CONTEXT)
    inputs, targets = held_out.tensors
    return TinyGPT(), windows(data[:split], stride=CONTEXT), inputs[:HELD_OUT], targets[:HELD_OUT]


def _mlp_data() -> tuple[Any, Any, Any, Any]:
    import lightning.pytorch as pl
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import TensorDataset

    class Classifier(pl.LightningModule):
        """64 -> 3 x 1024 -> 10 with ReLU: about 2.2M parameters for 1,437 training images."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            width = 1024
            self.net = nn.Sequential(
                nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
            )  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.loss(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9, nesterov=True)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = len(y) * 4 // 5
    return Classifier(), TensorDataset(x[:cut], y[:cut]), x[cut:], y[cut:]


class Schedule(NamedTuple):
    """The steps at which the loss is measured: ``step % period == offset``, in the warm-up or from ``first`` on."""

    period: int
    offset: int
    warmup: int
    first: int


def _eval_steps(variant: str, every: int) -> Schedule:
    """Every ``every`` steps; local SGD right after each sync is applied (and in its synchronous warm-up)."""
    if not variant.startswith("diloco"):
        return Schedule(every, 0, 0, every)
    config = _diloco(variant)
    every = config.first_sync_every  # "auto": measured at the provisional H's syncs (the H chosen is reported)
    warmup, overlap = config.warmup_steps, config.overlap_steps
    return Schedule(every, (warmup + overlap) % every, warmup, warmup + every + overlap)


def measuring(local_sgd: Any, step: int, schedule: Schedule) -> bool:
    """Whether the loss is measured after optimizer step ``step`` (see :class:`Schedule`), but with
    ``sync_every="auto"``, once the ranks chose, right after each sync of the chosen H (its windows count from the
    choice's sync; an overlapped sync is applied ``overlap_steps`` later). The same on every rank."""
    choice = getattr(local_sgd, "sync_every_choice", None)
    if choice is not None and step > choice.since:
        return (step - choice.since - local_sgd.config.overlap_steps) % choice.sync_every == 0
    period, offset, warmup, first = schedule
    return (step <= warmup or step >= first) and step % period == offset


def worker(args: argparse.Namespace) -> None:
    threads = os.environ.get("DDPOPT_BENCH_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = threads
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(int(threads))
    model, train, held_x, held_y = _gpt_data() if args.model == "gpt" else _mlp_data()
    schedule = _eval_steps(args.variant, args.eval_every)

    class LossClock(pl.Callback):
        """The validation loss at the measuring steps against the training wall time (evaluations left out)."""

        def __init__(self) -> None:
            self.curve: list[tuple[float, int, float]] = []
            self.start = self.excluded = 0.0
            self.seen = 0
            self.reached = False

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *rest: Any) -> None:
            step = trainer.global_step
            if step == self.seen:
                return
            self.seen = step
            last = step >= args.steps
            if not (last or measuring(getattr(trainer.strategy, "local_sgd", None), step, schedule)):
                return
            begun = time.perf_counter()
            elapsed = begun - self.start - self.excluded
            with torch.no_grad():
                loss = float(pl_module.loss((held_x, held_y)))
            self.curve.append((elapsed, step, loss))
            self.reached |= args.target is not None and loss <= args.target
            stop = last or (
                args.budget is not None
                and ((self.reached and elapsed >= args.budget) or elapsed >= args.budget * args.cap)
            )
            # Every rank stops at the same step: rank 0's clock decides.
            if trainer.strategy.broadcast(stop, src=0):
                trainer.should_stop = True
            self.excluded += time.perf_counter() - begun

    clock = LossClock()
    pl.seed_everything(0, verbose=False)
    alone = args.variant == "compute"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if alone else args.devices,
        num_nodes=1 if alone else args.num_nodes,
        strategy=make_strategy(args.variant),
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        ledger = getattr(trainer.strategy, "ledger", None)
        steps = list(ledger.steps) if ledger is not None else []
        sent = [s.wire_bytes or 0 for s in steps[2:]]
        result = {
            "variant": args.variant,
            "world_size": trainer.world_size,
            "curve": clock.curve,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes_per_step": statistics.fmean(sent) if sent else None,
            "step_times_s": [],  # cluster.run_variant reads this key of every compute process; the curve has the times
            "sync_every": getattr(getattr(trainer.strategy, "local_sgd", None), "sync_every", None),
            # sync_every="auto": what it chose from (H, sync_s, compute_s, exposed_share, since)
            "sync_every_choice": list(vars(choice).values())
            if (choice := getattr(getattr(trainer.strategy, "local_sgd", None), "sync_every_choice", None))
            else None,
        }
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- the driver


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The wall time at which the loss first reaches ``target``, linear between the measured points."""
    previous = (0.0, float("inf"))
    for elapsed, _step, loss in curve:
        if loss <= target:
            t0, l0 = previous
            if l0 == float("inf") or l0 == loss:
                return elapsed
            return t0 + (elapsed - t0) * (l0 - target) / (l0 - loss)
        previous = (elapsed, loss)
    return None


def loss_at(curve: list[list[float]], seconds: float) -> float | None:
    """The last measured loss at or before ``seconds`` of training."""
    measured = [loss for elapsed, _step, loss in curve if elapsed <= seconds * 1.001]
    return measured[-1] if measured else None


def steps_to(curve: list[list[float]], target: float) -> int | None:
    return next((int(step) for _elapsed, step, loss in curve if loss <= target), None)


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per variant: the medians over the rounds of its time to stock's loss, that time's ratio to stock's, the loss at
    stock's budget, and the steps it took."""
    rows = []
    for variant in [name for name in rounds[0] if name != "compute"]:
        sooner, seconds, losses, steps, of_limit, reached = [], [], [], [], [], 0
        for results in rounds:
            stock = results["stock"]
            target, budget = stock["curve"][-1][2], stock["curve"][-1][0]
            curve = results[variant]["curve"]
            when = time_to(curve, target)
            losses.append(loss_at(curve, budget))
            if when is not None:
                reached += 1
                seconds.append(when)
                sooner.append(budget / when)
                steps.append(steps_to(curve, target))
                if "compute" in results:  # stock's steps with no sync, at the same time as the others
                    of_limit.append(results["compute"]["curve"][-1][0] / when)
        first = rounds[0][variant]
        rows.append(
            {
                "variant": variant,
                "reached": f"{reached}/{len(rounds)}",
                "sooner": statistics.median(sooner) if reached == len(rounds) else None,
                "rounds_sooner": sooner,
                "seconds": statistics.median(seconds) if seconds else None,
                "loss_at_budget": statistics.median([x for x in losses if x is not None]) if any(losses) else None,
                "steps_to_target": statistics.median([s for s in steps if s is not None]) if steps else None,
                "bytes_per_step": first.get("bytes_per_step"),
                "of_limit": statistics.median(of_limit) if len(of_limit) == len(rounds) else None,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # worker mode, set by the driver
    parser.add_argument("--num-nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=None, help="comma-separated (default: every option for the layout)")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--rate", default="50mbit", help="tc rate of every host's link (default 50mbit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="stock's steps (default 80 gpt, 100 mlp)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--eval-every", type=int, default=8, help="steps between loss measurements (per-step sync)")
    parser.add_argument("--cap", type=float, default=2.0, help="budgets an option may train to reach the target")
    parser.add_argument("--loopback", action="store_true", help="no namespaces: every host on 127.0.0.1, unshaped")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--name", default=None, help="report stem (default time_to_loss_<model>_<hosts>x<ranks>)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--cap-steps", type=int, default=2000, help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, help="write RESULTS.md again from RESULTS.json (a results stem)")
    parser.add_argument(
        "--suite",
        action="store_true",
        help="the README's figures in one go: each layout of SUITE in turn, each file named with its rate",
    )
    args = parser.parse_args()
    if args.render is not None:
        render(args.render)
        return 0
    if args.variant is not None:
        worker(args)
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    layouts = [args] if not args.suite else [argparse.Namespace(**{**vars(args), **layout}) for layout in SUITE]
    for layout in layouts:  # a bad name fails before any run
        layout.steps = layout.steps if layout.steps is not None else 80 if layout.model == "gpt" else 100
        if layout.suite:
            layout.name = f"time_to_loss_{layout.model}_{layout.hosts}x{layout.ranks_per_host}_{layout.rate}"
        for variant in (layout.variants or "stock").split(","):
            try:
                make_strategy(variant)
            except (ValueError, TypeError) as error:
                parser.error(f"--variants: {variant!r} is not an option here ({error})")
    started = time.monotonic()
    for layout in layouts:
        measure(layout)
    if args.suite:
        print(f"the suite took {(time.monotonic() - started) / 60:.0f} min")
    return 0


def measure(args: argparse.Namespace) -> None:
    """Run ``args``' layout in interleaved rounds and write its report."""
    variants = (
        args.variants.split(",")
        if args.variants
        else ["stock", *GPT_VARIANTS[1:], *(TIERED_VARIANTS if args.ranks_per_host > 1 else ())]
    )
    if variants[0] != "stock":
        variants = ["stock", *[v for v in variants if v != "stock"]]
    why_not = None if args.loopback else can_emulate()
    if why_not:
        print(f"network namespaces unavailable ({why_not}): every host on loopback, unshaped", file=sys.stderr)
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every)]
    rounds: list[dict[str, dict[str, Any]]] = []
    started = time.monotonic()
    with Cluster(args.hosts, args.rate, loopback=args.loopback or why_not is not None) as cluster:
        for index in range(args.rounds):
            results: dict[str, dict[str, Any]] = {}
            for number, variant in enumerate(variants):
                if variant in ("stock", "compute"):
                    extra = ["--steps", str(args.steps)]
                else:
                    stock = results["stock"]["curve"][-1]
                    extra = ["--steps", str(args.cap_steps), "--target", str(stock[2]), "--budget", str(stock[0])]
                extra += ["--cap", str(args.cap)]
                port = 29600 + 7 * (index * len(variants) + number) % 2000
                results[variant] = run_variant(
                    cluster,
                    variant,
                    port,
                    [*common, *extra],
                    args.timeout,
                    args.ranks_per_host,
                    worker=Path(__file__),
                )
                curve = results[variant]["curve"]
                print(
                    f"round {index + 1} {variant}: {curve[-1][1]} steps, {curve[-1][0]:.1f} s, loss {curve[-1][2]:.4f}"
                    f" ({time.monotonic() - started:.0f} s in)",
                    flush=True,
                )
            rounds.append(results)
    rows = summarize(rounds)
    meta = {
        "model": args.model,
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host,
        "rate": args.rate,
        "link_bytes_per_s": parse_rate(args.rate),
        "emulated": not (args.loopback or why_not),
        "rounds": args.rounds,
        "stock_steps": args.steps,
        "cap": args.cap,
        "batch_size": args.batch_size,
        "date": datetime.date.today().isoformat(),
        "cpu_cores": os.cpu_count(),
        "command": " ".join(["benchmarks/time_to_loss.py", *sys.argv[1:]])
        + (
            f" (this file's layout: --model {args.model} --rate {args.rate} --eval-every {args.eval_every} "
            f"--variants {args.variants})"
            if args.suite
            else ""
        ),
        "minutes": (time.monotonic() - started) / 60,
    }
    name = args.name or f"time_to_loss_{args.model}_{args.hosts}x{args.ranks_per_host}"
    write_report(rows, rounds, meta, args.out, name)


def render(stem: Path) -> None:
    """Write ``stem.md`` again from ``stem.json`` (after a change to the report's layout)."""
    data = json.loads(stem.with_suffix(".json").read_text())
    write_report(data["rows"], data["rounds"], data["meta"], stem.parent, stem.name)


def write_report(
    rows: list[dict[str, Any]], rounds: list[dict[str, dict[str, Any]]], meta: dict[str, Any], out: Path, name: str
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "rounds": rounds}, indent=1))
    stock_targets = [r["stock"]["curve"][-1] for r in rounds]
    model = (
        "byte-level GPT (2 x width 128, context 64, AdamW 3e-3) on Python's pydoc topics"
        if meta["model"] == "gpt"
        else "MLP 64 -> 3 x 1024 -> 10 (SGD, Nesterov 0.9, lr 0.02) on scikit-learn's digits"
    )
    lines = [
        f"# Time to stock's validation loss: {meta['hosts']} hosts x {meta['ranks_per_host']} rank(s), {meta['rate']}",
        "",
        f"{model}; batch {meta['batch_size']} per rank; stock runs {meta['stock_steps']} steps: its validation loss "
        f"there is the target ({', '.join(f'{t[2]:.4f}' for t in stock_targets)} in the rounds), its training time "
        f"the budget ({', '.join(f'{t[0]:.1f} s' for t in stock_targets)}).",
        "",
        f"Command: `{meta['command']}`; run {meta['date']} on {meta['cpu_cores']} CPU cores, "
        "one torch thread per rank, "
        f"{'network namespaces with tc-shaped links' if meta['emulated'] else 'loopback, unshaped'}; "
        f"{meta['rounds']} interleaved rounds, medians; {meta['minutes']:.0f} min in all.",
        "",
    ]
    limits = [r["compute"]["curve"][-1][0] for r in rounds if "compute" in r]
    if limits:  # the compute-only limit: every rank alone, no sync, stock's steps
        lines += [
            f"The compute-only limit: stock's {meta['stock_steps']} steps with no sync (every rank alone, all at "
            f'once; rank 0\'s clock) took {", ".join(f"{t:.1f} s" for t in limits)}; "of the limit" is that time '
            "over an option's time to stock's loss (about 1 for stock on a link that cost nothing).",
            "",
        ]
    lines += [
        "| option | reaches stock's loss | time to it | of the limit | steps to it | loss at stock's time | "
        "sent per step | rounds (x sooner) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["sooner"] is None:
            sooner = f"not within {meta.get('cap', 2):g}x stock's time"
        elif row["sooner"] >= 1:
            sooner = f"**{row['sooner']:.2f}x sooner**"
        else:
            sooner = f"{row['sooner']:.2f}x ({1 / row['sooner']:.2f}x later)"
        if row["variant"] == "stock":
            sooner = "1.00x (the target)"
        seconds = "-" if row["seconds"] is None else f"{row['seconds']:.1f} s"
        steps = "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}"
        loss = "-" if row["loss_at_budget"] is None else f"{row['loss_at_budget']:.4f}"
        sent = "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f} MB"
        of_limit = "-" if row.get("of_limit") is None else f"{row['of_limit']:.2f}"
        per_round = ", ".join(f"{s:.2f}" for s in row["rounds_sooner"]) + f" ({row['reached']} reached)"
        lines.append(
            f"| {row['variant']} | {sooner} | {seconds} | {of_limit} | {steps} | {loss} | {sent} | {per_round} |"
        )
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
