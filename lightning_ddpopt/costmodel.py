"""Ring-allreduce alpha-beta cost model, link presets, the bytes each hook sends and its compression's compute."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CODEC_BYTES_PER_S",
    "DEFAULT_PLAN_HOOKS",
    "LINKS",
    "PLAN_HOOKS",
    "HookEstimate",
    "Link",
    "HIERARCHICAL_PLAN_HOOKS",
    "INTRA_NODE_GBPS",
    "allreduce_seconds",
    "bus_bandwidth",
    "choose_sync_every",
    "estimate_hooks",
    "hierarchical_seconds",
    "parse_count",
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

#: Each compressing hook's own compute, in fp32 gradient bytes per second, from this project's CPU measurements (one
#: torch thread, numba's kernels, PowerSGD at rank 4). A GPU's is far higher: ``ddpopt plan --codec-gb-per-s``.
CODEC_BYTES_PER_S: dict[str, float] = {
    # int8 56.8 ms, PowerSGD 47.5 ms per step: benchmarks/cpu_kernels.py, docs/performance.md "CPU kernels", 2026-12-01.
    "int8": _BENCH_GRADIENT_BYTES / 56.8e-3,
    "powersgd": _BENCH_GRADIENT_BYTES / 47.5e-3,
    # Not measured, so memory-bound: a cast there and back moves 12 bytes per element, 1.5 copy passes, and one copy
    # pass over the weight gradients took 8.6 ms (benchmarks/powersgd_hook.py, docs/performance.md, 2026-11-30).
    "fp16": _BENCH_WEIGHT_GRADIENT_BYTES / (1.5 * 8.6e-3),
    "bf16": _BENCH_WEIGHT_GRADIENT_BYTES / (1.5 * 8.6e-3),
}


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


def estimate_hooks(
    params: int,
    world_size: int,
    link: Link,
    step_compute_s: float | None,
    *,
    powersgd_rank: int = 4,
    matrix_width: int = 4096,
    int8_block: int = 1024,
    codec_bytes_per_s: float | None = None,
    hooks: tuple[str, ...] = DEFAULT_PLAN_HOOKS,
    nodes: tuple[int, int, Link] | None = None,
) -> list[HookEstimate]:
    """Bytes, compression compute, ring-allreduce time and scaling efficiency per hook for ``params`` fp32 gradients.

    PowerSGD's bytes assume the parameters are square ``matrix_width`` matrices: ``2 w r`` elements (its P and Q
    allreduces) instead of ``w^2`` each. int8 sends one byte per element plus a 4-byte scale per ``int8_block``
    elements, with a ring all-reduce's traffic (a reduce-scatter then an all-gather). Every hook's rank sends
    ``2 (n-1)/n`` of its payload.

    The compression's own compute (``codec_s``) is the fp32 gradient bytes over ``codec_bytes_per_s`` (default:
    :data:`CODEC_BYTES_PER_S` per hook; given, it applies to every hook that compresses); allreduce has none. It is
    assumed to run on the device that runs the backward pass, so it adds to the step's compute and cannot hide behind
    it: efficiency is ``compute / (compute + codec + comm)`` without overlap and ``compute / max(compute + codec,
    comm)`` with perfect overlap of communication and backward; ``None`` when ``step_compute_s`` is unknown.

    ``nodes`` is ``(N, M, intra-node link)`` for a world of N nodes x M ranks: ``link`` is then each node's link
    (which a flat ring's traffic crosses as the model says, M ranks sharing it), and the hooks with a two-tier form
    get its time too.
    """
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be at least 1")
    if step_compute_s is not None and step_compute_s <= 0:
        raise ValueError("--step-compute-ms must be positive")
    if codec_bytes_per_s is not None and codec_bytes_per_s <= 0:
        raise ValueError(f"codec_bytes_per_s {codec_bytes_per_s:g} must be positive")
    bytes_fp32 = params * 4.0
    per_hook = {
        "allreduce": bytes_fp32,
        "fp16": bytes_fp32 / 2,
        "bf16": bytes_fp32 / 2,
        "int8": params * (1.0 + 4.0 / int8_block),
        "powersgd": bytes_fp32 * min(1.0, 2 * powersgd_rank / matrix_width),
    }
    estimates = []
    for hook in hooks:
        nbytes = per_hook[hook]
        comm = allreduce_seconds(nbytes, world_size, link)
        throughput: float | None = None  # allreduce sends the gradient as it is: no codec
        if hook in CODEC_BYTES_PER_S:
            throughput = CODEC_BYTES_PER_S[hook] if codec_bytes_per_s is None else codec_bytes_per_s
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
        estimates.append(HookEstimate(hook, nbytes, sent, throughput, codec, comm, no_overlap, overlap, tiered))
    return estimates


#: DiLoCo's ``sync_every="auto"``: the H it may choose, and the share of H steps' compute one sync may take.
SYNC_EVERY_CHOICES = (4, 8, 16, 32, 64, 128)
SYNC_SHARE = 0.1  # placeholder: set from the time-to-loss benchmark's sweep (benchmarks/time_to_loss.py)


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
