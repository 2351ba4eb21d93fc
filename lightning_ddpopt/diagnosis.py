"""Turns the callbacks' measurements into findings: network -> compression -> AMP -> accumulation -> stragglers."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Any

import lightning.pytorch as pl

from lightning_ddpopt.fault_tolerance.finding import across_islands_finding, islands_finding, islands_summary
from lightning_ddpopt.finding import FINDINGS_TITLE, Finding, Status
from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd import PowerSGDState
from lightning_ddpopt.hooks.powersgd_rank import ERROR_BOUNDS, is_adaptive
from lightning_ddpopt.measuring import CoreViews, FrontEnd, MeasuringCallback
from lightning_ddpopt.units import format_bytes

__all__ = [
    "AREAS",
    "Status",
    "FINDINGS_TITLE",
    "NETWORK_ADVICE",
    "REPORT_NAME",
    "Finding",
    "diagnose",
    "format_findings",
    "network_advice_key",
    "summarize",
]

#: The file CommProfiler writes at the end of fit and ``ddpopt report`` reads.
REPORT_NAME = "ddpopt_report.json"

#: The areas of every run's findings; a fault-tolerant run adds ``"islands"`` after them.
AREAS = ("network", "compression", "amp", "accumulation", "stragglers")
#: An exposed sync (what the step waits for after its own backward compute) above this share of the step makes the
#: network the bottleneck.
COMM_SHARE_PROBLEM = 0.3
#: An exposed sync reaching less than this fraction of the link's measured bandwidth is not limited by the bytes.
LINK_UNDERUSED = 0.5
#: What the network finding advises when the exposed sync is a problem, by what the run syncs with (the key is
#: :func:`network_advice_key`'s). The comm hooks guide's order: int8 first, fp16/bf16 where int8's error is too high,
#: PowerSGD for very slow links, local SGD beyond that; a rank to lower only where the user fixed it. The
#: troubleshooting page shows this table, and a test keeps the two the same.
NETWORK_ADVICE: dict[str, str] = {
    "allreduce": (
        "use comm_hook='int8' (a quarter of the bytes, near-lossless; comm_hook='auto' times it on your link), or "
        "'bf16' / 'fp16' (half the bytes) where the compression finding shows int8's error too high"
    ),
    "cast": (
        "use comm_hook='int8' (half the bytes of a 16-bit cast) unless the compression finding showed its error too "
        "high; on a very slow link comm_hook='powersgd'"
    ),
    "int8": (
        "on a link this slow use comm_hook='powersgd' where the model has large weight matrices (its error bound keeps "
        "the quality), or local SGD (local_sgd=LocalSGDConfig.diloco(16)); accumulating more "
        "micro-batches per step also syncs less"
    ),
    "powersgd": (
        "its error bound sets PowerSGD's rank, so the bytes follow the gradients: use local SGD "
        "(local_sgd=LocalSGDConfig.diloco(16)), or accumulate more micro-batches per optimizer step"
    ),
    "powersgd_fixed_rank": (
        "lower PowerSGD's fixed rank of {rank} (PowerSGDConfig(rank=...)) if the compression finding allows, or use "
        "local SGD (local_sgd=LocalSGDConfig.diloco(16))"
    ),
    "local_sgd": (
        "sync less often (a larger sync_every), overlap the sync with training (overlap_steps) and send it in int8 "
        "(compression='int8')"
    ),
    "other": (
        "your own hook's bytes are the bottleneck: compare it with comm_hook='int8' (a quarter of fp32's bytes, "
        "near-lossless)"
    ),
}
#: The :data:`NETWORK_ADVICE` key of each hook known by its name alone.
_HOOK_ADVICE_KEYS = {"none": "allreduce", "allreduce": "allreduce", "fp16": "cast", "bf16": "cast", "int8": "int8"}
#: Step-time coefficient of variation above this is reported as jitter.
JITTER_CV = 0.2
#: Relative compression errors above which a lossy hook is reported as costing quality, by hook family, with an
#: adaptive optimizer (Adam and its kin) and with others. PowerSGD's are its ``max_error="auto"`` bounds (see
#: ``hooks.powersgd_rank.ERROR_BOUNDS``); int8's and the casts' lie well above what they lost nothing at on the same
#: benchmark (the docs' comm hooks guide).
COMPRESSION_ERROR_LIMITS = {
    "powersgd": (ERROR_BOUNDS["adaptive"], ERROR_BOUNDS["other"]),
    "int8": (0.05, 0.05),
    "cast": (0.01, 0.01),
}
#: What the compression finding advises when int8's or a cast's error is above its limit.
_LOSSY_ADVICE = {
    "int8": "gradients with outliers: use Int8Config(block_size=...) smaller, or comm_hook='bf16'",
    "cast": "gradients under- or overflow the cast: use comm_hook='bf16' (fp32's range) or 'allreduce'",
}
#: The compression finding advises int8 where flat PowerSGD sends more than this many times int8's bytes (its
#: estimate leaves out the rounding of a bucket's blocks to the world size).
INT8_MARGIN = 1.1
#: Local SGD drift (spread of the ranks' changes around their mean, relative to it) above which a finding is raised.
LOCAL_DRIFT_LIMIT = 1.0


def summarize(trainer: pl.Trainer) -> dict[str, Any]:
    """Collect what the run's measuring callbacks and strategy know, keyed by area (a JSON-ready dict).

    Args:
        trainer: the Trainer of the run, during or after fit.
    """
    strategy = trainer.strategy
    summary: dict[str, Any] = {
        "world_size": trainer.world_size,
        "strategy": type(strategy).__name__,
        "front_end": trainer.front_end if isinstance(trainer, FrontEnd) else "trainer",
        "comm_hook": strategy.comm_hook_name if isinstance(strategy, CoreViews) else None,
        "backend": getattr(strategy, "process_group_backend", None),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "optimizers": [type(optimizer).__name__ for optimizer in trainer.optimizers],
        "adaptive_optimizer": any(map(is_adaptive, trainer.optimizers)),
    }
    state = strategy.comm_state if isinstance(strategy, CoreViews) else None
    if isinstance(state, PowerSGDState):  # the rank in use, and the config's bound
        config = state.config
        summary["powersgd"] = {
            "rank": state.rank,  # the highest of the matrices' ranks
            "lowest_rank": state.ranks.lowest,
            "max_rank": config.max_rank,
            "max_error": state.error_bound,
            "int8_bytes": Int8Config().wire_bytes(state.gradient_sizes) if state.gradient_sizes else None,
        }
    ledger = strategy.ledger if isinstance(strategy, CoreViews) else None
    if ledger is not None and ledger.recording and ledger.total_steps:
        steps = list(ledger.steps)
        summary["ledger"] = {
            "optimizer_steps": ledger.total_steps,
            "sync_rounds_per_step": ledger.total_sync_rounds / ledger.total_steps,
            "max_sync_rounds": max(step.sync_rounds for step in steps),
            "micro_batches_per_step": sum(step.micro_batches for step in steps) / len(steps),
            # "device": times from CUDA events (device work); "host": host clocks.
            "clock": "device" if ledger.timeline.device_clock else "host",
        }
    local_sgd = strategy.local_sgd if isinstance(strategy, CoreViews) else None
    if local_sgd is not None:
        choice = local_sgd.sync_every_choice
        summary["local_sgd"] = {
            "sync_every": local_sgd.sync_every,  # H in use ("auto": the chosen one, or still the provisional one)
            # sync_every="auto": H and the figures it was chosen from (the ranks' agreed sync and step seconds).
            "sync_every_choice": None if choice is None else dataclasses.asdict(choice),
            "warmup_steps": local_sgd.config.warmup_steps,
            "syncs": local_sgd.syncs,
            "skipped_inner_steps": local_sgd.skipped_inner_steps,
        }
    stats = strategy.fault_tolerance_stats if isinstance(strategy, CoreViews) else None
    if stats is not None:
        summary["fault_tolerance"] = islands_summary(stats)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, MeasuringCallback):
            summary[callback.summary_key] = callback.summary()
    return summary


def diagnose(summary: dict[str, Any]) -> list[Finding]:
    """Findings for each area, in the debugging order: network, compression, AMP, accumulation, stragglers.

    A fault-tolerant run adds the islands' (their quorum, drops and heals).

    Args:
        summary: what :func:`summarize` returned, or a report's ``"summary"``.
    """
    findings = [_network(summary), _compression(summary), _amp(summary), _accumulation(summary), _stragglers(summary)]
    islands = islands_finding(summary)
    return findings if islands is None else [*findings, islands]


def format_findings(findings: list[Finding], width: int = 118) -> str:
    """A plain-text table: area, status, evidence and recommendation, wrapped to ``width`` columns.

    Args:
        findings: what :func:`diagnose` returned.
        width: the table's width in characters.
    """
    lines = [FINDINGS_TITLE]
    for finding in findings:
        head = f"  {finding.area:<13}{finding.status.upper():<9}"
        body = finding.evidence + (f" -> {finding.recommendation}" if finding.recommendation else "")
        wrapped = textwrap.wrap(body, width=width - len(head)) or [""]
        lines.append(head + wrapped[0])
        lines.extend(" " * len(head) + line for line in wrapped[1:])
    return "\n".join(lines)


def network_advice_key(summary: dict[str, Any]) -> str:
    """The key of :data:`NETWORK_ADVICE` for a run: its local SGD, or its hook's family.

    Args:
        summary: what :func:`summarize` returned.
    """
    hook = summary.get("comm_hook") or "none"
    if summary.get("local_sgd") is not None:
        return "local_sgd"
    if hook in _HOOK_ADVICE_KEYS:
        return _HOOK_ADVICE_KEYS[hook]
    powersgd = summary.get("powersgd")
    if "powersgd" in hook and powersgd is not None:  # our PowerSGD state: its rank and bound are known
        return "powersgd" if powersgd["max_error"] is not None else "powersgd_fixed_rank"
    return "other"


def _network(summary: dict[str, Any]) -> Finding:
    """Whether the step waits for the network: the exposed sync time, not the sync's span (the backward pass hides it).

    The span runs from the first bucket handed to the hook to the last one done; DDP starts it while the backward pass
    goes on computing the later buckets. What the step pays for the network is the exposed part, from the last bucket
    ready to the last result, on the rank that finished its backward pass last (the others also wait for it).
    """
    comm = summary.get("comm") or {}
    share = comm.get("exposed_share")
    if share is None:
        if comm.get("transfer_share") is not None:  # a report of an earlier release: the span only
            return Finding(
                "network",
                "unknown",
                f"this report measured the sync's span only ({comm['transfer_share']:.0%} of the step), which counts "
                "backward compute that overlaps the sync",
                "re-run with this release's CommProfiler: it measures the exposed sync, what the step waits for",
            )
        advice = "add CommProfiler() and train with OptimizedDDPStrategy on more than one process"
        across = across_islands_finding(summary, COMM_SHARE_PROBLEM)
        return across if across is not None else Finding("network", "unknown", "no sync time measured", advice)
    hook = summary.get("comm_hook") or "none"
    sync_ms, exposed_ms = comm["sync_time_ms"], comm["exposed_time_min_rank_ms"]
    evidence = f"sync {sync_ms:.1f} ms per step, of which {exposed_ms:.1f} ms exposed ({share:.0%} of the step)"
    # The mean covers the last rank too: the others' mean exposed time, less the last rank's, is their wait for it.
    ranks = summary.get("world_size") or 2
    waiting_ms = (ranks * comm["exposed_time_ms"] - exposed_ms) / max(ranks - 1, 1) - exposed_ms
    waiting = waiting_ms > 0.5 * exposed_ms and waiting_ms >= 1.0
    if waiting:
        evidence += (
            f"; the other ranks wait {waiting_ms:.1f} ms more, for the last rank to reach the sync (see stragglers)"
        )
    busy = comm.get("link_busy_share")
    if busy is not None:
        evidence += f"; link busy {busy:.0%} of the step"
    busbw, link = comm.get("busbw_gbps"), comm.get("link_busbw_gbps")
    if busbw:
        evidence += f" at {busbw:.3f} GB/s bus bandwidth"
        if link:
            evidence += f" ({busbw / link:.2f} of the measured link)"
    sent = comm.get("bytes_sent")
    if sent:
        evidence += f"; {format_bytes(sent)} sent per step"
    if comm.get("interval_steps"):
        # Not the run's mean (a summary over the whole run, warm-up included, can differ): say which figures these are.
        evidence += f" (means of the last {comm['interval_steps']} steps over all ranks)"
    evidence += f", hook {hook}"
    cv = comm.get("step_time_cv")
    if cv is not None and cv > JITTER_CV:
        evidence += f"; step time jitters (CV {cv:.2f}, p95 {comm.get('step_time_p95_ms', 0):.0f} ms)"
    if share < COMM_SHARE_PROBLEM:
        # The span the backward pass hides, on the mean rank (a rank waiting for a late one hides nothing: it waits).
        hidden_ms = sync_ms - comm["exposed_time_ms"]
        if comm.get("step_time_ms") and hidden_ms >= COMM_SHARE_PROBLEM * comm["step_time_ms"]:
            evidence += f"; the backward pass hides {hidden_ms:.1f} ms of the sync"
            if share < COMM_SHARE_PROBLEM / 2 and not waiting:  # a rank waiting for a late one is bound by it
                evidence += ": the step is compute-bound, and sending fewer bytes would not make it faster"
        return Finding("network", "ok", evidence)
    if busbw and link and busbw < LINK_UNDERUSED * link:
        advice = (
            "the exposed sync does not fill the link, so fewer bytes help little: its messages are too small (try "
            "a larger bucket_cap_mb)"
        )
        if network_advice_key(summary) != "allreduce":
            advice += f" or the hook's own compute is slow (compare {hook} with comm_hook='allreduce')"
        return Finding("network", "problem", evidence, advice)
    powersgd = summary.get("powersgd") or {}
    return Finding("network", "problem", evidence, NETWORK_ADVICE[network_advice_key(summary)].format(**powersgd))


def _compression(summary: dict[str, Any]) -> Finding:
    """What the sync's compression costs in quality: the lossy hook's measured error, or local SGD's drift.

    Judged on the profiler's latest interval (as the network finding; mid-run too), else on the run's means.
    """
    comm = summary.get("comm") or {}
    quality = comm.get("quality") or {}
    hook = summary.get("comm_hook") or "none"
    local_sgd = summary.get("local_sgd")
    drift = comm.get("local_drift", quality.get("local_drift"))
    if local_sgd is not None and drift is not None:
        every = local_sgd["sync_every"]
        evidence = (
            f"local SGD: the ranks' parameter changes spread {drift:.2f} x the mean change around it at a sync "
            f"(every {every} steps)"
        )
        if drift > LOCAL_DRIFT_LIMIT:
            advice = f"sync more often (sync_every below {every}) or lower the inner learning rate"
            return Finding("compression", "problem", evidence + f", above {LOCAL_DRIFT_LIMIT:g}", advice)
        return Finding("compression", "ok", evidence)
    error = comm.get("compression_error", quality.get("compression_error"))
    if error is None:
        if hook in ("none", "allreduce") and local_sgd is None:
            return Finding("compression", "ok", f"hook {hook}: gradients are synced exactly")
        return Finding(
            "compression",
            "unknown",
            f"hook {hook}: no compression error measured",
            "add CommProfiler() (it measures a lossy hook's error every error_every syncs)",
        )
    worst = comm.get("compression_error_max", quality.get("compression_error_max", error))
    family = _error_family(hook)
    optimizers = summary.get("optimizers") or []
    adaptive = summary.get("adaptive_optimizer", any(map(is_adaptive, optimizers)))
    limit = COMPRESSION_ERROR_LIMITS[family or "cast"][0 if adaptive else 1]
    evidence = f"hook {hook}: relative compression error {_error(error)} (worst rank {_error(worst)})"
    if "compression_error" in comm and comm.get("interval_steps"):
        evidence += f" over the last {comm['interval_steps']} steps"
    if "compression_error" in quality:
        measured = quality["compression_error_measured_syncs"]
        evidence += f"; over the run {_error(quality['compression_error'])} ({measured:g} measured syncs)"
    if family is None:  # a hook of the user's: its error is measured, but no limit is known for it
        evidence += "; no quality limit is known for this hook"
        advice = "compare its validation loss with comm_hook='allreduce' at equal steps"
        return Finding("compression", "unknown", evidence, advice)
    powersgd = summary.get("powersgd")
    if powersgd is not None:
        highest, lowest = powersgd["rank"], powersgd.get("lowest_rank", powersgd["rank"])  # earlier: one rank
        evidence += f"; rank {highest}" if lowest == highest else f"; ranks {lowest}-{highest} per matrix"
    int8_bytes = _heavier_than_int8(summary, comm) if family == "powersgd" else None
    if int8_bytes is not None:
        sent = format_bytes(comm["bytes_sent"])
        evidence += f"; it sends {sent} per step, more than int8's about {format_bytes(int8_bytes)} would"
        advice = "use comm_hook='int8': fewer bytes than PowerSGD at the ranks these gradients need, near-lossless"
        return Finding("compression", "problem", evidence, advice)
    if error <= limit:
        return Finding("compression", "ok", evidence)
    evidence += f"; above {limit:g} with {', '.join(optimizers) or 'this optimizer'}"
    if family != "powersgd":
        return Finding("compression", "problem", evidence, _LOSSY_ADVICE[family])
    rank, bound, top = (powersgd["rank"], powersgd["max_error"], powersgd["max_rank"]) if powersgd else (4, None, 4)
    if bound is not None and bound <= limit and rank < top:  # the bound is at work
        evidence += f", and the rank rises while the error is above max_error {bound:g}"
        return Finding("compression", "ok", evidence)
    if bound is None:
        advice = (
            f"raise PowerSGD's rank (PowerSGDConfig(rank={2 * rank})) or let it rise with the error "
            f"(PowerSGDConfig(max_error={limit:g})), or use comm_hook='int8' (error about 0.01)"
        )
    elif bound > limit:
        advice = f"lower the error bound: PowerSGDConfig(max_error={limit:g}), or use comm_hook='int8'"
    else:
        advice = f"the rank reached max_rank={rank}: raise PowerSGDConfig(max_rank=...), or use comm_hook='int8'"
    return Finding("compression", "problem", evidence, advice)


def _error_family(hook: str) -> str | None:
    """Which of :data:`COMPRESSION_ERROR_LIMITS` judges ``hook``'s error; ``None`` for a hook that is not ours."""
    family = next((name for name in ("powersgd", "int8") if name in hook), None)  # a two-tier form counts too
    return family or ("cast" if hook in ("fp16", "bf16") else None)


def _heavier_than_int8(summary: dict[str, Any], comm: dict[str, Any]) -> int | None:
    """int8's bytes where flat PowerSGD sent over ``INT8_MARGIN`` x them per step, else ``None``.

    ``None`` also where the bytes are not measured, for a two-tier sync (its bytes between nodes are this rank's
    share) and for an interval that compressed nothing (warm-up steps: ``bytes_sent`` is then the allreduce's).
    """
    int8 = (summary.get("powersgd") or {}).get("int8_bytes")
    if int8 is None or "bytes_sent" not in comm or comm.get("bytes_sent_intra_node"):
        return None
    if comm.get("compression_ratio", math.inf) <= 1.0:
        return None
    return int8 if comm["bytes_sent"] > INT8_MARGIN * int8 else None


def _error(value: float) -> str:
    """A relative error: three decimals, or two significant digits below 0.01 (fp16's are about 0.0004)."""
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2g}"


def _amp(summary: dict[str, Any]) -> Finding:
    amp = summary.get("amp")
    if amp is None:
        return Finding("amp", "unknown", "AMP not monitored", "add AMPMonitor() to see loss scale and skipped steps")
    problems = []
    if amp["nonfinite_steps"]:
        reports = amp.get("nonfinite_reports") or [{}]
        names = sorted({n for ns in (reports[-1].get("names") or {}).values() for n in ns})
        problems.append(f"{amp['nonfinite_steps']} steps had non-finite gradients (e.g. in {', '.join(names[:3])})")
    if not amp["scaler"]:
        if problems:
            return Finding("amp", "problem", "; ".join(problems), "lower the learning rate or clip gradients")
        return Finding("amp", "ok", f"no GradScaler; {amp['steps']} steps with finite gradients")
    scale = amp["scale"]
    recent = amp.get("recent_steps", min(amp["steps"], amp["window"]))  # a report of an earlier release lacks it
    evidence = (
        f"{amp['skipped_steps']} of {amp['steps']} steps skipped; skip rate {amp['skip_rate']:.1%} over the last "
        f"{recent} steps"
    )
    evidence += f", loss scale {scale:g}" if scale is not None else ""
    if scale is not None and scale < amp["underflow_threshold"]:
        problems.append(f"loss scale {scale:g} below {amp['underflow_threshold']:g}: gradients underflow")
    if amp["skip_rate"] > amp["skip_rate_threshold"]:
        problems.append(f"{amp['skip_rate']:.0%} of the last {recent} steps skipped")
    if not problems:
        return Finding("amp", "ok", evidence)
    return Finding(
        "amp", "problem", f"{evidence}; " + "; ".join(problems), "use precision='bf16-mixed' if the hardware has bf16"
    )


def _accumulation(summary: dict[str, Any]) -> Finding:
    ledger = summary.get("ledger")
    if ledger is None:
        return Finding("accumulation", "unknown", "no sync rounds counted", "train with OptimizedDDPStrategy")
    rounds, micro = ledger["sync_rounds_per_step"], ledger["micro_batches_per_step"]
    local_sgd = summary.get("local_sgd")
    if local_sgd is not None:  # few syncs are the point here, not a sign of anything missing
        chosen = " (chosen by sync_every='auto')" if local_sgd.get("sync_every_choice") else ""
        return Finding(
            "accumulation",
            "ok",
            f"local SGD: {rounds:.2f} syncs per optimizer step over {micro:.2f} micro-batches (parameters every "
            f"{local_sgd['sync_every']} steps{chosen} after {local_sgd['warmup_steps']} synchronous ones, "
            f"{local_sgd['syncs']} parameter syncs)",
        )
    evidence = f"{rounds:.2f} gradient syncs per optimizer step over {micro:.2f} micro-batches"
    if ledger["max_sync_rounds"] > 1:
        how = (
            "run every micro-batch but the last under fabric.no_backward_sync(model)"
            if summary.get("front_end") == "fabric"
            else "Trainer(accumulate_grad_batches=K), or strategy.accumulate(every=K) with manual optimization"
        )
        return Finding("accumulation", "problem", evidence, f"sync only on the last micro-batch: {how}")
    comm = summary.get("comm") or {}
    advice = "accumulating K micro-batches per step would cut the sync cost per sample by K (scale the LR with it)"
    synced_often = micro <= 1 and (comm.get("exposed_share") or 0) >= COMM_SHARE_PROBLEM
    return Finding("accumulation", "ok", evidence, advice if synced_often else "")


def _stragglers(summary: dict[str, Any]) -> Finding:
    stragglers = summary.get("stragglers")
    if stragglers is None:
        return Finding("stragglers", "unknown", "not measured", "add StragglerDetector()")
    if stragglers.get("last") is None:
        why = stragglers.get("no_verdict") or "no window was analysed"
        return Finding("stragglers", "unknown", f"no verdict: {why}")
    last = stragglers["last"]
    per_rank = last["per_rank_ms"][str(last["slowest_rank"])]
    if not last["is_straggler"]:
        return Finding(
            "stragglers",
            "ok",
            f"no straggler: the slowest rank ({last['slowest_rank']}) is {last['excess_ms']:.0f} ms/step above the "
            "median",
        )
    rank, phase = last["slowest_rank"], last["phase"]
    named = stragglers.get("straggler_windows", {}).get(str(rank), 0)
    evidence = (
        f"rank {rank} is {last['excess_ms']:.0f} ms/step slower than the median rank, in {phase} "
        f"(data {per_rank['data']:.0f} ms, compute {per_rank['compute']:.0f} ms, optimizer "
        f"{per_rank.get('optimizer', 0.0):.0f} ms per step); the other ranks wait for it; named in {named} of "
        f"{stragglers.get('windows', 0)} windows"
    )
    advice = _STRAGGLER_ADVICE.get(phase, _STRAGGLER_ADVICE["compute"]).format(rank=rank)
    return Finding("stragglers", "problem", evidence, advice)


#: What the stragglers finding advises, by the phase the slowest rank is slow in.
_STRAGGLER_ADVICE = {
    "data": "rank {rank} waits for data: raise num_workers (and pin_memory) there, check its storage and CPU load",
    "optimizer": (
        "rank {rank} is slow after its backward pass: check what runs there only on that rank (callbacks in "
        "on_before_optimizer_step, gradient clipping, an optimizer with state offloaded) and its device load"
    ),
    "compute": (
        "rank {rank} computes slowly: check its device for throttling or other processes; on CPUs try cpu_affinity=True"
    ),
}
