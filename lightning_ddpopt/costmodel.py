"""Ring-allreduce alpha-beta cost model: link presets, each hook's bytes and compression compute, and the advice."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from lightning_ddpopt.units import format_seconds

__all__ = [
    "CODEC_BYTES_PER_S",
    "DEFAULT_PLAN_HOOKS",
    "DEVICES",
    "GPU_CODEC_BYTES_PER_S",
    "GPU_COPY_PASSES",
    "GPU_MEMORY_BYTES_PER_S",
    "LINKS",
    "MIN_STEP_GAIN",
    "PLAN_HOOKS",
    "POWERSGD_SETTLED_RANK",
    "POWERSGD_START_RANK",
    "RECOMMENDED_HOOKS",
    "Device",
    "HookEstimate",
    "Link",
    "HIERARCHICAL_PLAN_HOOKS",
    "INTRA_NODE_GBPS",
    "Recommendation",
    "BACKWARD_SHARE",
    "allreduce_seconds",
    "bus_bandwidth",
    "choose_sync_every",
    "codec_rate",
    "estimate_hooks",
    "hierarchical_seconds",
    "parse_count",
    "recommend",
    "resolve_link",
    "ring_bytes_per_rank",
]


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bytes/s (per direction) and per-message latency in seconds."""

    name: str
    bytes_per_s: float
    latency_s: float
    summary: str


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


#: Nominal line rates; real Ethernet reaches about 80-90% of them.
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("1gbe", _gbit(1), 50e-6, "1 Gbit/s Ethernet"),
        Link("10gbe", _gbit(10), 50e-6, "10 Gbit/s Ethernet"),
        Link("25gbe", _gbit(25), 30e-6, "25 Gbit/s Ethernet"),
        Link("100gbe", _gbit(100), 20e-6, "100 Gbit/s Ethernet (RoCE)"),
        Link("ib-hdr", _gbit(200), 5e-6, "InfiniBand HDR, 200 Gbit/s"),
        Link("ib-ndr", _gbit(400), 5e-6, "InfiniBand NDR, 400 Gbit/s"),
    )
}


def resolve_link(name: str | None, gbps: float | None = None, latency_us: float | None = None) -> Link:
    """A preset by name, or a custom link from ``gbps`` (Gbit/s); ``latency_us`` overrides the latency."""
    if gbps is not None:
        if gbps <= 0:
            raise ValueError(f"--gbps {gbps:g} must be positive")
        base = Link(f"{gbps:g}gbit", _gbit(gbps), 50e-6, f"{gbps:g} Gbit/s link")
    elif name is None:
        raise ValueError(f"--link or --gbps is required: a link preset ({', '.join(LINKS)}) or a bandwidth in Gbit/s")
    elif name.lower() not in LINKS:
        raise ValueError(f"unknown link preset {name!r}; choose one of {', '.join(LINKS)}, or give --gbps")
    else:
        base = LINKS[name.lower()]
    if latency_us is None:
        return base
    if latency_us < 0:
        raise ValueError(f"--latency-us {latency_us:g} must not be negative")
    return Link(base.name, base.bytes_per_s, latency_us * 1e-6, base.summary)


def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2 (n-1)/n * S``; 0 for one process."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes


def allreduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """Ring allreduce lower bound: ``2 (n-1)/n * S / B + 2 (n-1) * latency``; 0 for one process."""
    if world_size <= 1:
        return 0.0
    return ring_bytes_per_rank(nbytes, world_size) / link.bytes_per_s + 2 * (world_size - 1) * link.latency_s


#: An intra-node link's default bandwidth in Gbit/s: PCIe 4.0 x16, one direction (NVLink is 4-20x faster).
INTRA_NODE_GBPS = 256.0
#: The hooks with a two-tier form (:mod:`lightning_ddpopt.hooks.hierarchical`, ``hierarchical_int8``,
#: ``hierarchical_powersgd``).
HIERARCHICAL_PLAN_HOOKS = ("allreduce", "fp16", "bf16", "int8", "powersgd")


def hierarchical_seconds(
    fp32_bytes: float,
    payload_bytes: float,
    nodes: int,
    per_node: int,
    link: Link,
    intra: Link,
    gather_bytes: float | None = None,
) -> float:
    """Two-tier sync time on N nodes x M ranks (``nodes``, ``per_node``), its tiers one after the other.

    Inside each node a reduce-scatter of the fp32 bucket (PowerSGD's all-to-all to the owners moves as much) and an
    all-gather of ``gather_bytes`` (the fp32 bucket by default; int8 gathers its int8 payload, PowerSGD its factors),
    ``(M-1)/M`` of each over the intra-node link; between nodes M
    all-reduces of 1/M of the payload each, which share the node's link: ``2 (N-1)/N x S`` over it, and ``2 (N-1)``
    latencies. The CPU path pipelines its tiers across buckets and all-reduces inside the node (gloo): give
    ``intra`` the bandwidth its inner tier reaches.
    """
    gathered = fp32_bytes if gather_bytes is None else gather_bytes
    inside = ring_bytes_per_rank((fp32_bytes + gathered) / 2, per_node) / intra.bytes_per_s
    inside += 2 * (per_node - 1) * intra.latency_s
    return inside + allreduce_seconds(payload_bytes, nodes, link)


def bus_bandwidth(algorithm_bytes_per_s: float, world_size: int) -> float:
    """NCCL's bus bandwidth of an allreduce: ``algbw * 2 (n-1) / n``, comparable with the link's rate."""
    if world_size <= 1:
        return 0.0
    return algorithm_bytes_per_s * 2 * (world_size - 1) / world_size


def parse_count(text: str) -> int:
    """``"100M"``, ``"1.5B"``, ``"350k"`` or ``"1000000"`` as an int."""
    suffixes = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
    cleaned = text.strip().lower()
    factor = suffixes.get(cleaned[-1:], 1.0)
    number = cleaned[:-1] if cleaned[-1:] in suffixes else cleaned
    try:
        value = float(number) * factor
    except ValueError:
        raise ValueError(f"{text!r} is not a count; write e.g. 100M, 1.5B, 350k or 1000000") from None
    if value <= 0:
        raise ValueError(f"{text!r} must be positive")
    return int(value)


#: The hooks ``ddpopt plan`` compares unless told otherwise.
DEFAULT_PLAN_HOOKS = ("allreduce", "fp16", "int8", "powersgd")
#: Every hook the cost model knows.
PLAN_HOOKS = ("allreduce", "fp16", "bf16", "int8", "powersgd")

# The benchmarks' model, 6 x Linear(2048, 2048): its fp32 gradient bytes, and those of its weight matrices alone.
_BENCH_GRADIENT_BYTES = 6 * (2048 * 2048 + 2048) * 4
_BENCH_WEIGHT_GRADIENT_BYTES = 6 * 2048 * 2048 * 4

#: The devices ``ddpopt plan --device`` prices a hook's compression on.
Device = Literal["cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("cpu", "gpu")

#: Each compressing hook's own compute, in fp32 gradient bytes per second, from this project's CPU measurements (one
#: torch thread, numba's kernels, PowerSGD at rank 4; :func:`codec_rate` prices other ranks).
CODEC_BYTES_PER_S: dict[str, float] = {
    # int8 56.8 ms, PowerSGD 47.5 ms per step: benchmarks/cpu_kernels.py, docs/performance.md "CPU kernels", 2026-12-01.
    "int8": _BENCH_GRADIENT_BYTES / 56.8e-3,
    "powersgd": _BENCH_GRADIENT_BYTES / 47.5e-3,
    # Not measured, so memory-bound: a cast there and back moves 12 bytes per element, 1.5 copy passes, and one copy
    # pass over the weight gradients took 8.6 ms (benchmarks/powersgd_hook.py, docs/performance.md, 2026-11-30).
    "fp16": _BENCH_WEIGHT_GRADIENT_BYTES / (1.5 * 8.6e-3),
    "bf16": _BENCH_WEIGHT_GRADIENT_BYTES / (1.5 * 8.6e-3),
}
# PowerSGD's CPU time at rank 4 split in two: its memory floor, 4 copy passes over the weight gradients (read M and the
# stored error, write M; read M for P; read M for Q; read M, write the error and the decompressed M: docs/performance.md
# "Its own work against a memory floor"), which does not grow with the rank, and the rest, the products with the thin
# factors, which grows linearly with it (6 r flops per element). An estimate from two measurements, not a measurement.
_POWERSGD_CPU_FLOOR_S = 4 * 8.6e-3
_POWERSGD_CPU_PRODUCTS_S_AT_4 = 47.5e-3 - _POWERSGD_CPU_FLOOR_S

#: An H100-class GPU's memory bandwidth, bytes/s: the H100 PCIe's nominal 2.0 TB/s, the lower of the two parts' (the
#: SXM part's HBM3 is 3.35 TB/s nominal), which no kernel fully reaches. Not measured: ``ddpopt plan`` says so.
GPU_MEMORY_BYTES_PER_S = 2.0e12
#: Copy passes (a read and a write of every fp32 gradient element, 8 bytes) each hook's compression costs on a GPU,
#: where torch's kernels run it unfused (numba's fused loops are CPU-only). Counted from the code, not measured.
GPU_COPY_PASSES = {
    # a cast to half precision and back: 12 bytes per element.
    "fp16": 1.5,
    "bf16": 1.5,
    # about 120 bytes per element: error feedback added, the blocks' peak (two reductions), scaled and rounded, packed
    # to int8, the error formed; the owner's dequantise, sum and requantise; the dequantise into the bucket.
    "int8": 15.0,
    # twice its memory floor of 4 passes: each product with a thin factor reads M on its own, and the error and the
    # decompressed M are written apart. Memory-bound up to rank 64: its 6 r = 384 flops per element there take under
    # a fifth of the memory time at an H100's peak of 67 fp32 TFLOP/s.
    "powersgd": 8.0,
}
#: Each compressing hook's own compute on an H100-class GPU, in fp32 gradient bytes per second: an estimate,
#: memory-bound (:data:`GPU_MEMORY_BYTES_PER_S` over the bytes of its copy passes), not a measurement.
GPU_CODEC_BYTES_PER_S: dict[str, float] = {  # a copy pass moves 2 bytes per byte of fp32 gradient
    hook: GPU_MEMORY_BYTES_PER_S / (2 * passes) for hook, passes in GPU_COPY_PASSES.items()
}

#: The default PowerSGD (``PowerSGDConfig()``): the rank it starts at, and the rank it settled at in this project's
#: runs, which the plan prices as the upper end. With AdamW the matrices of the small GPT settled at ranks 32-64
#: (``benchmarks/results/transformer_quality_rank_per_matrix.md``, 2026-12-04); with SGD and Nesterov momentum at 8
#: (``transformer_quality_sgd.md``, 2026-12-02); 64 is also ``PowerSGDConfig.max_rank``'s default.
POWERSGD_START_RANK = 4
POWERSGD_SETTLED_RANK = 64


def codec_rate(hook: str, device: Device = "cpu", powersgd_rank: int = POWERSGD_START_RANK) -> float | None:
    """fp32 gradient bytes per second ``hook``'s compression processes on ``device``; ``None`` for allreduce.

    On ``"cpu"`` this project's one-thread measurements (:data:`CODEC_BYTES_PER_S`), PowerSGD's priced at other ranks
    than the measured 4 by scaling the part of its time that grows with the rank. On ``"gpu"`` an estimate
    (:data:`GPU_CODEC_BYTES_PER_S`), the same at every rank up to 64.
    """
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if hook not in CODEC_BYTES_PER_S:
        return None
    if device == "gpu":
        return GPU_CODEC_BYTES_PER_S[hook]
    if hook == "powersgd":
        seconds = _POWERSGD_CPU_FLOOR_S + _POWERSGD_CPU_PRODUCTS_S_AT_4 * powersgd_rank / 4
        return _BENCH_GRADIENT_BYTES / seconds
    return CODEC_BYTES_PER_S[hook]


@dataclass(frozen=True)
class HookEstimate:
    """What one hook costs per optimizer step under the model.

    Attributes:
        hook: the hook's name, one of :data:`PLAN_HOOKS`.
        payload_bytes: what the hook hands its collectives per step, the compressed gradient (allreduce: the fp32
            gradient): the ``S`` of the ring formula. O(P) whatever the world size.
        sent_bytes_per_rank: bytes one rank sends per step under the ring model, ``2 (n-1)/n * payload_bytes``.
        codec_bytes_per_s: fp32 gradient bytes the hook's compression (compressing and decompressing) processes per
            second; ``None`` for allreduce, which has no codec.
        codec_s: the compression's own compute per step, ``4 P / codec_bytes_per_s``; 0 for allreduce.
        comm_s: ring-allreduce time of ``payload_bytes`` on the link.
        efficiency_no_overlap: ``compute / (compute + codec_s + comm_s)``; ``None`` when the step's compute time is
            unknown.
        efficiency_full_overlap: ``compute / max(compute + codec_s, comm_s)``; ``None`` when the step's compute time
            is unknown.
        hierarchical_comm_s: the two-tier sync's time (:func:`hierarchical_seconds`) on N nodes x M ranks; ``None``
            for a flat world or a hook without a two-tier form.
        powersgd_rank: the rank PowerSGD is priced at; ``None`` for the other hooks.
    """

    hook: str
    payload_bytes: float
    sent_bytes_per_rank: float
    codec_bytes_per_s: float | None
    codec_s: float
    comm_s: float
    efficiency_no_overlap: float | None
    efficiency_full_overlap: float | None
    hierarchical_comm_s: float | None = None
    powersgd_rank: int | None = None


def estimate_hooks(
    params: int,
    world_size: int,
    link: Link,
    step_compute_s: float | None,
    *,
    powersgd_rank: int | None = None,
    matrix_width: int = 4096,
    int8_block: int = 1024,
    device: Device = "cpu",
    codec_bytes_per_s: float | None = None,
    hooks: tuple[str, ...] = DEFAULT_PLAN_HOOKS,
    nodes: tuple[int, int, Link] | None = None,
) -> list[HookEstimate]:
    """Bytes, compression compute, ring-allreduce time and scaling efficiency per hook for ``params`` fp32 gradients.

    PowerSGD's bytes assume the parameters are square ``matrix_width`` matrices: ``2 w r`` elements (its P and Q
    allreduces) instead of ``w^2`` each. ``powersgd_rank`` prices a fixed rank; ``None`` prices the default PowerSGD,
    whose rank rises under its error bound, at both ends, one estimate each: :data:`POWERSGD_START_RANK` and
    :data:`POWERSGD_SETTLED_RANK`. int8 sends one byte per element plus a 4-byte scale per ``int8_block`` elements,
    with a ring all-reduce's traffic (a reduce-scatter then an all-gather). Every hook's rank sends ``2 (n-1)/n`` of
    its payload.

    The compression's own compute (``codec_s``) is the fp32 gradient bytes over ``codec_bytes_per_s`` (default:
    :func:`codec_rate` per hook on ``device``; given, it applies to every hook that compresses); allreduce has none.
    It is assumed to run on the device that runs the backward pass, so it adds to the step's compute and cannot hide
    behind it: efficiency is ``compute / (compute + codec + comm)`` without overlap and ``compute / max(compute + codec,
    comm)`` with perfect overlap of communication and backward; ``None`` when ``step_compute_s`` is unknown.

    ``nodes`` is ``(N, M, intra-node link)`` for a world of N nodes x M ranks: ``link`` is then each node's link
    (which a flat ring's traffic crosses as the model says, M ranks sharing it), and the hooks with a two-tier form
    get its time too.
    """
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be at least 1")
    if step_compute_s is not None and not (math.isfinite(step_compute_s) and step_compute_s > 0):
        raise ValueError(f"--step-compute-ms {step_compute_s * 1e3:g} must be a positive, finite number of ms")
    if codec_bytes_per_s is not None and codec_bytes_per_s <= 0:
        raise ValueError(f"codec_bytes_per_s {codec_bytes_per_s:g} must be positive")
    if powersgd_rank is not None and powersgd_rank < 1:
        raise ValueError(f"--rank {powersgd_rank} must be at least 1")
    bytes_fp32 = params * 4.0
    ranks = (POWERSGD_START_RANK, POWERSGD_SETTLED_RANK) if powersgd_rank is None else (powersgd_rank,)
    rows: list[tuple[str, float, int | None]] = []
    for hook in hooks:
        if hook == "powersgd":
            rows += [(hook, bytes_fp32 * min(1.0, 2 * rank / matrix_width), rank) for rank in ranks]
            continue
        per_element = {"allreduce": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / int8_block}[hook]
        rows.append((hook, params * per_element, None))
    estimates = []
    for hook, nbytes, rank in rows:
        comm = allreduce_seconds(nbytes, world_size, link)
        throughput: float | None = None  # allreduce sends the gradient as it is: no codec
        if hook in CODEC_BYTES_PER_S:
            throughput = codec_rate(hook, device, rank or POWERSGD_START_RANK)
            if codec_bytes_per_s is not None:
                throughput = codec_bytes_per_s
        codec = 0.0 if throughput is None else bytes_fp32 / throughput
        no_overlap = overlap = None
        if step_compute_s is not None:
            no_overlap = step_compute_s / (step_compute_s + codec + comm)
            overlap = step_compute_s / max(step_compute_s + codec, comm)
        sent = ring_bytes_per_rank(nbytes, world_size)
        tiered = None
        if nodes is not None and nodes[0] > 1 and nodes[1] > 1 and hook in HIERARCHICAL_PLAN_HOOKS:
            # int8 gathers its quantised shards inside the node, PowerSGD its owners' factors: their payload.
            gather = nbytes if hook in ("int8", "powersgd") else None
            tiered = hierarchical_seconds(bytes_fp32, nbytes, nodes[0], nodes[1], link, nodes[2], gather)
        estimates.append(HookEstimate(hook, nbytes, sent, throughput, codec, comm, no_overlap, overlap, tiered, rank))
    return estimates


#: DiLoCo's ``sync_every="auto"``: the H it may choose, and the share of H steps' compute one sync may take.
SYNC_EVERY_CHOICES = (4, 8, 16, 32, 64, 128)
#: Set on the time-to-loss benchmark (the local SGD guide, "Choosing H from the run", gives the figures).
SYNC_SHARE = 0.1


def choose_sync_every(sync_s: float, compute_s: float, exposed_share: float = 1.0) -> int:
    """DiLoCo's H for a sync of ``sync_s`` seconds and ``compute_s`` seconds of compute per optimizer step.

    The smallest H of :data:`SYNC_EVERY_CHOICES` at which the sync's exposed time (``exposed_share`` of it: 1 for a
    blocking sync, less when it is overlapped with the next steps) is at most :data:`SYNC_SHARE` of the compute of H
    steps; the largest when none is. The same rule serves ``LocalSGDConfig(sync_every="auto")``, from a run's
    measured figures, and ``ddpopt plan``, from the cost model's.
    """
    if not sync_s >= 0 or not compute_s > 0:
        raise ValueError(f"choose_sync_every needs sync_s >= 0 and compute_s > 0, got {sync_s!r} and {compute_s!r}")
    exposed = sync_s * exposed_share
    for every in SYNC_EVERY_CHOICES:
        if exposed <= SYNC_SHARE * every * compute_s:
            return every
    return SYNC_EVERY_CHOICES[-1]


#: The hooks :func:`recommend` chooses among: the near-lossless ones, as ``comm_hook="auto"`` does by default
#: (low-rank compression can cost quality, which a time estimate does not see).
RECOMMENDED_HOOKS = ("allreduce", "fp16", "int8")
#: Each step up in complexity (fp16 over allreduce, int8 over fp16, two tiers over flat, DiLoCo over a per-step hook)
#: must make the modelled step this much faster than the choice before it, as ``comm_hook="auto"`` asks a hook to beat
#: allreduce's sync by this factor.
MIN_STEP_GAIN = 1.1
#: The share of a step's compute a gradient sync can hide behind: the backward pass, about twice the forward's work.
BACKWARD_SHARE = 2 / 3
#: ``LocalSGDConfig.diloco()``'s wire: the parameter change in fp16, 2 bytes per parameter.
_DILOCO_WIRE_BYTES = 2.0
_NEEDS_COMPUTE = "--step-compute-ms: one step's forward+backward time without communication"


@dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` advises for a run, and why.

    Attributes:
        strategy: the advice as the strategy's arguments, e.g. ``OptimizedDDPStrategy(comm_hook="int8",
            hierarchical=True)``.
        hook: the comm hook of every step's gradient sync, one of :data:`RECOMMENDED_HOOKS`; ``None`` with DiLoCo,
            whose replicas sync no gradients between parameter syncs (islands: in fp32 inside their node).
        hierarchical: whether the hook syncs in two tiers on N nodes x M ranks.
        sync_every: DiLoCo's H (``LocalSGDConfig.diloco(H)``), from :func:`choose_sync_every`; ``None`` for a
            per-step hook.
        sync_s: the advice's sync: a per-step hook's codec and communication per step; DiLoCo's parameter sync,
            once every H steps.
        step_s: the advice's modelled step (:func:`recommend`); ``None`` when the step's compute is unknown.
        allreduce_step_s: flat allreduce's modelled step, to compare; ``None`` when the step's compute is unknown.
        reason: why, in one or two sentences.
        needs: what the advice lacks, or ``None``: without the step's compute it compares the syncs alone and cannot
            weigh DiLoCo.
    """

    strategy: str
    hook: str | None
    hierarchical: bool
    sync_every: int | None
    sync_s: float
    step_s: float | None
    allreduce_step_s: float | None
    reason: str
    needs: str | None = None


def recommend(
    params: int,
    world_size: int,
    link: Link,
    step_compute_s: float | None,
    *,
    nodes: tuple[int, int, Link] | None = None,
    device: Device = "cpu",
    codec_bytes_per_s: float | None = None,
    int8_block: int = 1024,
) -> Recommendation:
    """The comm hook, two tiers or not, or DiLoCo with its H, for ``params`` parameters on this world and link.

    The arguments are :func:`estimate_hooks`'. A step is modelled as its compute, the compression's own work, and
    what is left of the sync once the backward pass (:data:`BACKWARD_SHARE` of the compute) is over: the sync
    overlaps the backward pass only, between the plan's two efficiencies. The rule:

    1. The per-step options, simplest first: each of :data:`RECOMMENDED_HOOKS` flat and, on N > 1 nodes x M > 1
       ranks, in two tiers. An option replaces the choice so far only if its step is :data:`MIN_STEP_GAIN` times
       faster: a link is fast for allreduce where nothing makes the step 1.1x faster than allreduce does.
    2. DiLoCo where even the cheapest per-step sync (codec and communication) is longer than the step's compute (the
       local SGD guide's "when even compressed gradient syncs cost more than the compute") and its step is 1.1x
       faster than the choice: ``LocalSGDConfig.diloco(H)``, islands of a node each on N x M ranks
       (``replica="auto"``), the fp16 parameter change all-reduced between the replicas, H from
       :func:`choose_sync_every` on that sync and the step's compute. An island's step adds its fp32 gradient
       all-reduce inside the node (overlapping the backward pass), and its sync the all-gather of the new
       parameters there.

    Without ``step_compute_s`` the options are compared on their syncs alone, DiLoCo is not weighed, and ``needs``
    says so.
    """
    estimates = estimate_hooks(
        params,
        world_size,
        link,
        step_compute_s,
        int8_block=int8_block,
        device=device,
        codec_bytes_per_s=codec_bytes_per_s,
        hooks=RECOMMENDED_HOOKS,
        nodes=nodes,
    )
    compute = 0.0 if step_compute_s is None else step_compute_s
    options = []  # simplest first
    for estimate in estimates:
        options.append(_Option(estimate.hook, False, estimate.codec_s, estimate.comm_s))
        if estimate.hierarchical_comm_s is not None:
            options.append(_Option(estimate.hook, True, estimate.codec_s, estimate.hierarchical_comm_s))
    flat_allreduce = choice = options[0]
    for option in options[1:]:
        if option.step_s(compute) * MIN_STEP_GAIN <= choice.step_s(compute):
            choice = option
    cheapest = min(options, key=lambda option: option.sync_s)
    tiers = f", hierarchical={choice.tiered}" if any(option.tiered for option in options) else ""

    def per_step(step_s: float | None, allreduce_step_s: float | None, reason: str) -> Recommendation:
        return Recommendation(
            strategy=f'OptimizedDDPStrategy(comm_hook="{choice.hook}"{tiers})',
            hook=choice.hook,
            hierarchical=choice.tiered,
            sync_every=None,
            sync_s=choice.sync_s,
            step_s=step_s,
            allreduce_step_s=allreduce_step_s,
            reason=reason,
            needs=None if step_compute_s is not None else _NEEDS_COMPUTE,
        )

    if step_compute_s is None:
        versus = (
            "" if choice == flat_allreduce else f" against {format_seconds(flat_allreduce.sync_s)} for flat allreduce"
        )
        return per_step(
            None,
            None,
            f"{choice.label}: {format_seconds(choice.sync_s)} of codec and sync a step{versus}, compared on the syncs "
            "alone; whether that matters, and whether DiLoCo would pay, depends on the step's compute.",
        )
    step, allreduce_step = choice.step_s(compute), flat_allreduce.step_s(compute)
    if cheapest.sync_s > compute:
        diloco = _diloco(params, world_size, link, compute, nodes)
        if diloco is not None and diloco[2] * MIN_STEP_GAIN <= step:
            every, outer, diloco_step, where = diloco
            return Recommendation(
                strategy=f"OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco({every}))",
                hook=None,
                hierarchical=False,
                sync_every=every,
                sync_s=outer,
                step_s=diloco_step,
                allreduce_step_s=allreduce_step,
                reason=f"even the cheapest per-step sync ({cheapest.label}, {format_seconds(cheapest.sync_s)}) is "
                f"longer than the {format_seconds(compute)} of compute; DiLoCo's fp16 sync {where} "
                f"({format_seconds(outer)}) every {every} steps makes a step of {format_seconds(diloco_step)}, against "
                f"{format_seconds(step)} for {choice.label}. It needs more steps to a given loss, fewer seconds (the "
                "local SGD guide).",
            )
    if choice == flat_allreduce:
        versus = "nothing makes it 1.1x faster"
    else:
        versus = f"{allreduce_step / step:.2f}x faster than flat allreduce ({format_seconds(allreduce_step)})"
    if cheapest.sync_s <= compute:
        keeps_up = "a sync shorter than the compute needs no DiLoCo"
    else:
        keeps_up = "every per-step sync is longer than the compute, but DiLoCo would not be 1.1x faster"
    codec = "" if choice.hook == "allreduce" else f"{format_seconds(choice.codec_s)} of codec, "
    return per_step(
        step,
        allreduce_step,
        f"{choice.label}: a step of {format_seconds(step)} ({codec}{format_seconds(choice.exposed_s(compute))} of its "
        f"{format_seconds(choice.comm_s)} sync left after the backward pass), {versus}; {keeps_up}.",
    )


class _Option(NamedTuple):
    """A per-step hook, flat or in two tiers, and what it costs a step."""

    hook: str
    tiered: bool
    codec_s: float
    comm_s: float

    @property
    def label(self) -> str:
        return f"{self.hook} in two tiers" if self.tiered else f"flat {self.hook}"

    @property
    def sync_s(self) -> float:
        return self.codec_s + self.comm_s

    def exposed_s(self, compute_s: float) -> float:
        """The sync's time left once the backward pass is over."""
        return max(0.0, self.comm_s - BACKWARD_SHARE * compute_s)

    def step_s(self, compute_s: float) -> float:
        """Compute, the codec (on the device that computes), and the sync's exposed time."""
        return compute_s + self.codec_s + self.exposed_s(compute_s)


def _diloco(
    params: int, world_size: int, link: Link, compute_s: float, nodes: tuple[int, int, Link] | None
) -> tuple[int, float, float, str] | None:
    """DiLoCo's H, its sync's time, its modelled step and where it syncs; ``None`` for a one-replica world."""
    if nodes is not None and nodes[0] > 1 and nodes[1] > 1:
        replicas, per_node, intra = nodes
        # Each island rank sends its shard's change to its peers on the other nodes (M rings sharing the node's
        # link, as an all-reduce of the whole change between the nodes), then the island gathers the new parameters.
        gather = (per_node - 1) / per_node * 4.0 * params / intra.bytes_per_s + (per_node - 1) * intra.latency_s
        outer = allreduce_seconds(_DILOCO_WIRE_BYTES * params, replicas, link) + gather
        inner = max(0.0, allreduce_seconds(4.0 * params, per_node, intra) - BACKWARD_SHARE * compute_s)
        where = f"between the {replicas} nodes' islands"
    else:
        replicas = world_size
        outer = allreduce_seconds(_DILOCO_WIRE_BYTES * params, replicas, link)
        inner = 0.0
        where = f"between the {replicas} ranks"
    if replicas < 2:
        return None
    every = choose_sync_every(outer, compute_s)
    return every, outer, compute_s + inner + outer / every, where
