"""Ring-allreduce alpha-beta cost model, link presets, and the bytes each hook sends."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_PLAN_HOOKS",
    "LINKS",
    "PLAN_HOOKS",
    "HookEstimate",
    "Link",
    "allreduce_seconds",
    "bus_bandwidth",
    "estimate_hooks",
    "parse_count",
    "resolve_link",
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


def allreduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """Ring allreduce lower bound: ``2 (n-1)/n * S / B + 2 (n-1) * latency``; 0 for one process."""
    if world_size <= 1:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s


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


@dataclass(frozen=True)
class HookEstimate:
    """What one hook costs per optimizer step under the model."""

    hook: str
    bytes_per_step: float
    comm_s: float
    efficiency_no_overlap: float | None
    efficiency_full_overlap: float | None


def estimate_hooks(
    params: int,
    world_size: int,
    link: Link,
    step_compute_s: float | None,
    *,
    powersgd_rank: int = 4,
    matrix_width: int = 4096,
    int8_block: int = 1024,
    hooks: tuple[str, ...] = DEFAULT_PLAN_HOOKS,
) -> list[HookEstimate]:
    """Bytes, ring-allreduce time and scaling efficiency per hook for ``params`` fp32 gradients.

    PowerSGD's bytes assume the parameters are square ``matrix_width`` matrices: ``2 w r`` elements instead of
    ``w^2`` each. int8 sends one byte per element plus a 4-byte scale per ``int8_block`` elements, with a ring
    all-reduce's traffic (a reduce-scatter then an all-gather). Efficiency is ``compute / (compute + comm)``
    without overlap and ``compute / max(compute, comm)`` with perfect overlap of communication and backward;
    ``None`` when ``step_compute_s`` is unknown.
    """
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be at least 1")
    if step_compute_s is not None and step_compute_s <= 0:
        raise ValueError("--step-compute-ms must be positive")
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
        if step_compute_s is None:
            estimates.append(HookEstimate(hook, nbytes, comm, None, None))
            continue
        no_overlap = step_compute_s / (step_compute_s + comm)
        overlap = step_compute_s / max(step_compute_s, comm)
        estimates.append(HookEstimate(hook, nbytes, comm, no_overlap, overlap))
    return estimates
