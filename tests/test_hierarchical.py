"""Nodes x ranks: the topology read from the launcher, the two-tier sync against the flat one, bytes per tier.

The ranks start as on a cluster: the test starts one process per "node" with ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (tests/nodes_worker.py), and Lightning starts that node's other ranks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.hooks import AutoConfig, PowerSGDConfig
from lightning_ddpopt.hooks.compression import FP16_WARN_FROM_RANKS, flat_fp16_note
from lightning_ddpopt.topology import TierGroups, Topology, discover
from tests.helpers import user_environment
from tests.nodes_worker import FITS, HOOKS, SLOW_MS, TIERED

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_nodes(
    out: Path,
    nodes: int,
    ranks_per_node: int,
    fits: list[str],
    tiered_hook: str = "fp16",
    rank_zero: bool = False,
    timeout: float = 400,
    fabric: bool = False,
    gpus: bool = False,
    worker: str = "tests.nodes_worker",
) -> str:
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    processes = []
    for node in range(nodes):
        env = user_environment(ROOT)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        env.update(DDPOPT_TEST_NODES=str(nodes), DDPOPT_TEST_RANKS_PER_NODE=str(ranks_per_node))
        env.update(DDPOPT_TEST_FITS=",".join(fits), DDPOPT_TEST_TIERED_HOOK=tiered_hook)
        if rank_zero:  # rank 0 is the slow rank and the overflowing one
            env.update(DDPOPT_TEST_RANK_ZERO="1")
        if gpus:  # each node its own GPUs, as on a cluster
            first = node * ranks_per_node
            visible = ",".join(str(gpu) for gpu in range(first, first + ranks_per_node))
            env.update(DDPOPT_TEST_ACCELERATOR="gpu", CUDA_VISIBLE_DEVICES=visible)
        with open(out / f"output{node}.txt", "w") as output:
            command = [sys.executable, "-m", worker, str(out), *(["fabric"] if fabric else [])]
            processes.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    done = [out / f"done_rank{rank}" for rank in range(nodes * ranks_per_node)]
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            if any(code not in (None, 0) for code in codes) or all(path.exists() for path in done):
                break
            time.sleep(0.2)
        output = "".join((out / f"output{node}.txt").read_text() for node in range(nodes))
        assert all(path.exists() for path in done), f"exit codes {codes}\n{output[-5000:]}"
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return output


def _records(out: Path, fit: str, world: int) -> list[dict]:
    return [torch.load(out / f"{fit}_rank{rank}.pt", weights_only=False) for rank in range(world)]


def _int8_tier_bytes(numels: list[int], members: list[list[int]], nodes: int, per_node: int, block: int) -> tuple:
    """The two-tier int8 bytes, per step, of buckets holding ``members``: between nodes (the packed shard) and inside.

    Each parameter's blocks split into ``per_node`` runs; run r goes to local rank (r + the parameter's first block
    in the model) mod M; each shard padded to the most blocks, rounded up to a multiple of the nodes.
    """
    firsts, first = [], 0
    for numel in numels:
        firsts.append(first)
        first += math.ceil(numel / block)
    wire = intra = 0
    for bucket in members:
        owned = [0] * per_node
        for index in bucket:
            count = math.ceil(numels[index] / block)
            for owner in range(per_node):
                run = (owner - firsts[index]) % per_node
                owned[owner] += (run + 1) * count // per_node - run * count // per_node
        shard = math.ceil(max(owned) / nodes) * nodes
        wire += shard * (block + 4)
        intra += per_node * shard * block * 4
    return wire, intra


_POWERSGD_FLAT = (
    "ddpopt: flat sync over {} nodes x {} ranks: PowerSGD sends only its factors between the ranks; its two-tier form "
    "moves each node's fp32 gradients inside the node to split the compression work, which over gloo costs more than "
    "it saves (hierarchical=True uses it)"
)


def _choice_line(nodes: int, ranks_per_node: int, hook: str, hierarchical: bool | str) -> str:
    crossing = {
        "allreduce": "the bucket's precision",
        "fp16": "fp16",
        "bf16": "bf16",
        "int8": "int8 blocks",
        "powersgd": "PowerSGD's fp32 factors",
    }[hook]
    return (
        f"ddpopt: hierarchical sync over {nodes} nodes x {ranks_per_node} ranks: each bucket summed inside the node in "
        f"its own precision, 1/{ranks_per_node} of it per rank sent between nodes in {crossing}, gathered inside the "
        f"node (hierarchical={hierarchical!r})"
    )


@pytest.mark.parametrize(
    ("nodes", "ranks_per_node", "chosen", "tiered_hook", "rank_zero"),
    [
        # (the *_tiers fits are "auto"'s on gloo, with True: for NCCL, tests/test_gpu.py)
        pytest.param(
            2,
            2,
            [*(name for name in FITS if not name.endswith("_tiers")), "resume", "callbacks"],
            "int8",
            False,
            id="2x2",
        ),
        # rank 0 slow and overflowing
        pytest.param(
            3, 2, ["fp16", "int8", "callbacks", "callbacks_powersgd"], "fp16", True, id="3x2", marks=pytest.mark.slow
        ),
        # 8 ranks: a smoke run (PowerSGD: 4 owners per node)
        pytest.param(2, 4, ["int8", "powersgd"], "fp16", False, id="2x4", marks=pytest.mark.slow),
        # two-tier PowerSGD through Lightning's checkpoint
        pytest.param(2, 2, ["resume"], "powersgd", False, id="2x2-powersgd-resume", marks=pytest.mark.slow),
    ],
)
def test_nodes_sync_in_two_tiers_like_the_flat_sync(tmp_path, nodes, ranks_per_node, chosen, tiered_hook, rank_zero):
    output = _run_nodes(tmp_path, nodes, ranks_per_node, chosen, tiered_hook, rank_zero)
    world = nodes * ranks_per_node
    expected_nodes = tuple(tuple(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes))
    runs = [name for name in chosen if name != "resume"] + (
        ["resume_full", "resume_half"] if "resume" in chosen else []
    )
    fits = {name: _records(tmp_path, name, world) for name in runs}
    said: dict[str, int] = {}
    for name, ranks in fits.items():
        # The callbacks' and resumed fits: 'auto' (PowerSGD: True).
        hook = name.partition("_")[2] if name.startswith("callbacks_") else tiered_hook
        hook, setting = FITS.get(name, (hook, TIERED.get(hook, "auto")))
        # Every rank as the launcher placed it, and the topology read from it.
        assert [r["rank"] for r in ranks] == [(g, g // ranks_per_node, g % ranks_per_node, world) for g in range(world)]
        # hierarchical=False reads no topology (no gather of host names at setup).
        assert {r["nodes"] for r in ranks} == {None if setting is False else expected_nodes}, name
        # "auto" keeps PowerSGD flat on gloo (saying why).
        hierarchical = setting is True or (setting == "auto" and hook != "powersgd")
        if hook == "powersgd" and setting == "auto":
            line = _POWERSGD_FLAT.format(nodes, ranks_per_node)
            said[line] = said.get(line, 0) + 1
        # Data parallel: every rank ends with the same parameters, bit for bit.
        for r in ranks[1:]:
            torch.testing.assert_close(r["params"], ranks[0]["params"], rtol=0, atol=0, msg=name)
        states = {
            "int8": ("HierarchicalInt8State", "Int8State"),
            "powersgd": ("HierarchicalPowerSGDState", "PowerSGDState"),
        }.get(hook, ("HierarchicalState", "CommHookState"))
        assert {r["state"] for r in ranks} == {states[0] if hierarchical else states[1]}, name
        if hierarchical:
            line = _choice_line(nodes, ranks_per_node, hook, setting)
            said[line] = said.get(line, 0) + 1
        # Bytes per tier, exactly. fp32/fp16/bf16: each bucket padded to a multiple of the node's ranks; inside the
        # node the bucket in fp32, between nodes this rank's 1/M shard in the hook's dtype (fp16: and its peak).
        # int8: whole blocks.
        checked = 0
        for r in ranks:
            assert len(r["steps"]) == {"resume_full": 8, "resume_half": 4}.get(name, 8), name
            for step, (logical, wire, intra, buckets) in enumerate(r["steps"]):
                assert logical == sum(buckets) == r["params"].numel() * 4
                if hook == "int8" and hierarchical:
                    # Steps in DDP's final buckets (the first steps of a fit have others, before DDP rebuilds them).
                    final = [sum(4 * r["numels"][i] for i in bucket) for bucket in r["buckets"]]
                    if sorted(buckets) == sorted(final):
                        expected = _int8_tier_bytes(r["numels"], r["buckets"], nodes, ranks_per_node, 1024)
                        assert (wire, intra) == expected, name
                        checked += 1
                    continue
                if hook == "int8":
                    continue  # the flat int8 hook's bytes: tests/test_int8.py
                if hook == "powersgd" and not hierarchical:
                    assert intra == 0, name  # flat: its bytes are tests/test_powersgd_state.py's
                    continue
                if hook == "powersgd":
                    # Inside the node the all-to-all to the owners and the owners' payloads (DDP's final buckets);
                    # between nodes the owners' part: checked per node below.
                    final = [sum(4 * r["numels"][i] for i in bucket) for bucket in r["buckets"]]
                    if sorted(buckets) == sorted(final):
                        sync = step + (4 if name == "resume_half" else 0)  # resumed after 4 syncs
                        compressing = HOOKS[hook] if sync >= HOOKS[hook].start_iter else None
                        assert intra == _powersgd_intra_bytes(
                            r["owners"], r["shapes"], r["buckets"], compressing, HOOKS[hook].rank
                        ), name
                        checked += 1
                    continue
                itemsize = 4 if hook == "allreduce" else 2
                numels = [-(-b // 4 // ranks_per_node) for b in buckets]
                if hierarchical:  # fp16: and each shard's fp32 peak, for the scale the nodes agree on
                    assert wire == sum(numels) * itemsize + (4 * len(buckets) if hook == "fp16" else 0), name
                    assert intra == sum(n * ranks_per_node * 4 for n in numels), name
                else:
                    assert wire == logical * itemsize // 4 and intra == 0, name
        if hook in ("int8", "powersgd") and hierarchical:
            assert checked >= world * (len(ranks[0]["steps"]) - 2), (name, checked)
        if hook == "powersgd" and hierarchical:
            # Each parameter crosses from its owner alone: a node's ranks send, between them, what flat PowerSGD
            # sends from each rank: the whole model exactly before start_iter, then the factors and the rest exactly.
            config = HOOKS[hook]
            factors = sum(
                (shape[0] + shape[1]) * config.rank * 4
                if len(shape) == 2 and config.compresses(shape[0], shape[1])
                else math.prod(shape) * 4
                for shape in ranks[0]["shapes"]
            )
            for node in range(nodes):
                members = ranks[node * ranks_per_node : (node + 1) * ranks_per_node]
                sent = [sum(r["steps"][step][1] for r in members) for step in range(len(members[0]["steps"]))]
                logical = members[0]["steps"][0][0]
                first = 4 if name == "resume_half" else 0  # resumed after 4 syncs
                expected = [logical if first + step < config.start_iter else factors for step in range(len(sent))]
                assert sent == expected, name
    if "flat_allreduce" in fits:
        # The two-tier fp32 sync sums in another order than the flat one: equal to float rounding after 8 steps.
        flat = fits["flat_allreduce"][0]["params"]
        torch.testing.assert_close(fits["allreduce"][0]["params"], flat, rtol=1e-5, atol=1e-6)
        # Compression crosses the nodes only: as close to fp32 as the flat sync with the same hook (int8: within
        # 1.25x of it: its shards are quantised once per node, the flat hook's gradients once per rank).
        for name, atol in (("fp16", 2e-3), ("bf16", 2e-2), ("int8", 2e-3)):
            error = (fits[name][0]["params"] - flat).abs().max().item()
            assert error < atol, (name, error)
        for name, factor in (("fp16", 1.0), ("int8", 1.25)):
            flat_error = (fits[f"flat_{name}"][0]["params"] - flat).abs().max().item()
            assert (fits[name][0]["params"] - flat).abs().max().item() <= factor * flat_error, name
    # The choice is said once per fit, with the layout and what crosses the nodes.
    for line, count in said.items():
        assert output.count(line) == count, (line, output[-3000:])
    if "resume_full" in fits:
        # Resumed from the first epoch's checkpoint, every rank ends bit for bit where the uninterrupted run did.
        for full, resumed in zip(fits["resume_full"], fits["resume_half"], strict=True):
            torch.testing.assert_close(resumed["params"], full["params"], rtol=0, atol=0)
    for name in [name for name in fits if name.startswith("callbacks")]:
        # fp16 AMP: one rank's overflow (rank 0's, or node 1's first) reaches every rank through both tiers, and
        # every rank skips that step.
        for r in fits[name]:
            assert (r["amp"]["steps"], r["amp"]["skipped_steps"]) == (8, 1), (name, r["amp"])
        # The callbacks attached: the slow rank (local rank 1 of node 1, or rank 0) named from its own figures.
        slow_rank = 0 if rank_zero else ranks_per_node + 1
        last = fits[name][0]["stragglers"]["last"]
        assert (last["slowest_rank"], last["phase"], last["is_straggler"]) == (slow_rank, "compute", True), last
        # Most of its sleep, not all: up to 6 ranks share 2 cores, and the others' compute stretches while it sleeps.
        assert last["excess_ms"] > 0.5 * SLOW_MS, last
        comm = fits[name][0]["comm"]
        # Means over the ranks (two-tier PowerSGD's ranks send different shares) of the interval's steps (alike).
        wire = sum(r["steps"][-1][1] for r in fits[name]) / world
        intra = sum(r["steps"][-1][2] for r in fits[name]) / world
        assert (comm["bytes_sent"], comm["bytes_sent_intra_node"]) == pytest.approx((wire, intra)), name
        # Host time per tier, per step: the interval's mean (its 4 steps, alike) over the ranks, as the ledger has it.
        for tier, column in (("intra_node_ms", 0), ("cross_node_ms", 1)):
            per_rank = [sum(s[column] for s in r["tier_seconds"][-4:]) / 4 for r in fits[name]]
            assert comm[tier] == pytest.approx(sum(per_rank) / world * 1e3), (name, tier)
            assert all(seconds > 0 for r in fits[name] for s in r["tier_seconds"] for seconds in s), (name, tier)
        # Its bus bandwidth is the node link's: M rings between the nodes (one rank per node each) share it.
        assert comm["busbw_gbps"] == pytest.approx(comm["algbw_gbps"] * 2 * (nodes - 1) / nodes * ranks_per_node)


def _one_rank_group(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )


@pytest.mark.quick
def test_the_topology_of_one_rank_and_its_words(tmp_path):
    _one_rank_group(tmp_path)
    try:
        topology = discover(node_rank=0, local_rank=0)
    finally:
        dist.destroy_process_group()
    assert topology == Topology(rank=0, nodes=((0,),))
    assert not topology.tiered
    assert Topology(rank=3, nodes=((0, 1), (2, 3))).describe() == "2 nodes x 2 ranks"
    assert Topology(rank=1, nodes=((0,), (1,))).describe() == "2 nodes x 1 rank"
    uneven = Topology(rank=0, nodes=((0, 1, 2), (3, 4)))
    assert uneven.describe() == "2 nodes with 3, 2 ranks" and not uneven.tiered
    assert (
        Topology(rank=3, nodes=((0, 1), (2, 3))).node_rank,
        Topology(rank=3, nodes=((0, 1), (2, 3))).local_rank,
    ) == (1, 1)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("claims", "message"),
    [
        (
            [("a", 0, 0), ("b", 0, 1)],
            "the ranks of node 0 run on 2 hosts (ranks [0] on host 'a'; ranks [1] on host 'b')",
        ),
        ([("a", 0, 0), ("a", 0, 0)], "ranks 0 and 1 both claim local rank 0 on node 0"),
        ([("a", 0, 0), ("a", 2, 0)], "node ranks [0, 2] are not 0..1"),
        ([("a", 0, 0), ("a", 0, 2)], "node 0's local ranks are [0, 2], not 0..1"),
    ],
)
def test_a_launcher_whose_claims_disagree_with_the_hosts_is_refused(monkeypatch, claims, message):
    def gather(out, _claim, group=None):
        out[:] = claims

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(claims))
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: list(range(len(claims))))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError) as raised:
        discover(node_rank=claims[0][1], local_rank=claims[0][2], group=object())  # type: ignore[arg-type]
    assert message in str(raised.value)


def _user_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hierarchical": "yes"}, "hierarchical='yes' must be True, False or 'auto'"),
        ({"hierarchical": 1}, "hierarchical=1 must be True, False or 'auto'"),
        (
            {"hierarchical": True, "comm_hook": "batched_powersgd"},
            "hierarchical=True needs a comm_hook with a hierarchical form ('allreduce', 'fp16', 'bf16', 'int8', "
            "'powersgd', 'powersgd_fp16', 'powersgd_bf16', or 'auto'), not comm_hook='batched_powersgd'",
        ),
        (
            {"hierarchical": True, "comm_hook": PowerSGDConfig(batched=True)},
            "batched PowerSGD makes one matrix of a whole bucket, which has no two-tier form; pass batched=False or "
            "hierarchical='auto'",
        ),
        ({"hierarchical": True, "comm_hook": None}, "not comm_hook=None"),
        (
            {"hierarchical": True, "ddp_comm_hook": _user_hook},
            "hierarchical=True applies to the registry hooks with a two-tier form ('allreduce', 'fp16', 'bf16', "
            "'int8', 'powersgd', 'powersgd_fp16', 'powersgd_bf16'), not to ddp_comm_hook=",
        ),
    ],
)
def test_bad_hierarchical_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError) as raised:
        OptimizedDDPStrategy(**kwargs)
    assert message in str(raised.value)
    # What is accepted: a hook with a two-tier form, or "auto" (every hook it may choose has one).
    OptimizedDDPStrategy(hierarchical=True, comm_hook=AutoConfig(candidates=("allreduce", "fp16", "int8", "powersgd")))
    OptimizedDDPStrategy(hierarchical=True, comm_hook=PowerSGDConfig(matrix_dtype="bf16"))
    OptimizedDDPStrategy(hierarchical=True, comm_hook="powersgd_fp16")
    OptimizedDDPStrategy(hierarchical=True, comm_hook="bf16")
    OptimizedDDPStrategy(hierarchical=True, comm_hook="int8")
    OptimizedDDPStrategy(hierarchical=True, comm_hook="auto")  # its default candidates all have a two-tier form


def _forked_2x2(rank: int, world_size: int, port: int, loops: bool) -> TierGroups:
    """A forked rank of 2 nodes x 2 ranks on gloo, one torch thread, and its tiers' groups; without ``loops`` the
    torch path instead of numba's loops."""
    import lightning_ddpopt.hooks._kernels as kernels

    if not loops:
        kernels.available = lambda: False  # this forked process takes the torch path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return TierGroups(Topology(rank=rank, nodes=((0, 1), (2, 3))))


def _int8_tiers_worker(rank: int, world_size: int, port: int, out: str, loops: bool, cap_mb: float) -> None:
    """Six steps of a raw DDP model through the two-tier int8 hook on 2 nodes x 2 ranks (a GradScaler's growth and
    backoff, one step whose gradient overflows on rank 2), saving every step's gradient and the errors."""
    from lightning_ddpopt._groups import destroy_all_groups
    from lightning_ddpopt.hooks import HierarchicalInt8State, Int8Config, hierarchical_int8_hook
    from lightning_ddpopt.ledger import CommLedger

    tiers = _forked_2x2(rank, world_size, port, loops)
    torch.manual_seed(0)
    # Odd sizes: no parameter fills whole blocks; the cap sets how DDP groups them into buckets.
    module = torch.nn.Sequential(
        torch.nn.Linear(101, 37), torch.nn.Tanh(), torch.nn.Linear(37, 53), torch.nn.Tanh(), torch.nn.Linear(53, 7)
    )
    model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap_mb)
    scale = torch.ones(())
    ledger = CommLedger(error_every=1)
    state = HierarchicalInt8State(
        config=Int8Config(block_size=INT8_BLOCK), tiers=tiers, ledger=ledger, loss_scale=lambda: scale
    )
    state.bind_module(module)
    model.register_comm_hook(state, ledger.record_hook(hierarchical_int8_hook))
    data = torch.Generator().manual_seed(rank)
    grads, local = [], []
    for step, loss_scale in enumerate((1.0, 1.0, 8.0, 4.0, 4.0, 4.0)):
        scale.fill_(loss_scale)
        model.zero_grad()
        inputs = torch.randn(8, 101, generator=data) * (100.0 if rank == step % world_size else 1.0)
        if step == INT8_OVERFLOW_STEP and rank == 2:
            inputs[0, 0] = math.inf
        loss = model.module(inputs).pow(2).mean() * loss_scale
        local.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(module.parameters()))]))
        (model(inputs).pow(2).mean() * loss_scale).backward()
        ledger.close_step()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    saved = state.state_dict()
    torch.save(
        {
            "grads": grads,
            "local": local,
            "errors": dict(state.errors),
            "skipped": saved["skipped_rounds"],
            "config": saved["config"],
            "wire": [(s.wire_bytes, s.intra_node_bytes) for s in ledger.steps],
            "numels": [p.numel() for p in module.parameters()],
        },
        f"{out}.{rank}",
    )
    state.close()
    tiers.close()
    del model, state
    destroy_all_groups()


INT8_BLOCK = 16
INT8_OVERFLOW_STEP = 4


def test_int8_in_two_tiers_gives_the_same_bits_whatever_the_buckets_and_the_kernels(tmp_path):
    pytest.importorskip("numba")
    results = {}
    for loops, cap_mb in ((True, 0.001), (False, 0.001), (True, 25.0)):
        out = str(tmp_path / f"tiers-{loops}-{cap_mb}")
        mp.start_processes(
            _int8_tiers_worker, args=(4, _free_port(), out, loops, cap_mb), nprocs=4, start_method="fork"
        )
        results[loops, cap_mb] = [torch.load(f"{out}.{rank}") for rank in range(4)]
    fast = results[True, 0.001]
    for other in (results[False, 0.001], results[True, 25.0]):  # torch's kernels; one bucket instead of several
        for rank in range(4):
            for step, (a, b) in enumerate(zip(fast[rank]["grads"], other[rank]["grads"], strict=True)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"rank {rank}, step {step}")
            assert fast[rank]["errors"].keys() == other[rank]["errors"].keys()
            for name, error in fast[rank]["errors"].items():
                torch.testing.assert_close(error, other[rank]["errors"][name], rtol=0, atol=0, msg=name)
    numels = fast[0]["numels"]
    blocks = [math.ceil(n / INT8_BLOCK) for n in numels]
    for r in fast:
        # Every rank decodes the same bytes: the same gradient everywhere, every step.
        for step, grad in enumerate(r["grads"]):
            torch.testing.assert_close(grad, fast[0]["grads"][step], rtol=0, atol=0, equal_nan=True)
        # The overflow reached every rank as a non-finite gradient, and no rank committed that round's errors.
        assert not r["grads"][INT8_OVERFLOW_STEP].isfinite().all() and r["skipped"] == 1
        assert r["config"] == {
            "block_size": INT8_BLOCK,
            "error_feedback": True,
            "tiers": "2 nodes x 2 ranks: [[0, 1], [2, 3]]",
        }
    # Error feedback for the blocks this rank owns only: the ranks of a node hold every block once between them.
    for node in (fast[:2], fast[2:]):
        assert sum(e.numel() for r in node for e in r["errors"].values()) == sum(blocks) * INT8_BLOCK
    assert max(sum(e.numel() for e in r["errors"].values()) for r in fast) <= (sum(blocks) // 2 + 6) * INT8_BLOCK
    # The mean over the 4 ranks, within int8's steps: each block's error is at most half a step of the node's sum
    # (quantised) and of the sum over the nodes (re-quantised); error feedback carries it into the next step.
    for step in range(2):  # the first steps: no feedback added yet in step 0; the bound holds loosely after
        exact = sum(r["local"][step] for r in fast) / 4
        error = (fast[0]["grads"][step] - exact).abs().max().item()
        assert error <= 2 * exact.abs().max().item() / 127, (step, error)
    # Bytes per step: the packed shard (int8 payload and one fp32 scale per block) between nodes, the padded fp32
    # shards inside the node; with one bucket (25 MiB cap): each parameter's blocks split in two runs.
    for r in results[True, 25.0]:
        owned = [0, 0]
        first = 0
        for count in blocks:
            for owner in range(2):
                run = (owner - first) % 2
                owned[owner] += (run + 1) * count // 2 - run * count // 2
            first += count
        shard = -(-max(owned) // 2) * 2
        assert r["wire"] == [(shard * (INT8_BLOCK + 4), 2 * shard * INT8_BLOCK * 4)] * 6


class _Dot(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))

    def forward(self, coefficients: torch.Tensor) -> torch.Tensor:
        return (coefficients * self.weight).sum()


def _fp16_tiers_worker(rank: int, world_size: int, port: int, out: str, factor: int) -> None:
    """One backward pass of ``sum(c * w)`` (gradient ``c``: magnitudes from 1e-8 to 1e2) through the two-tier fp16
    hook and the flat one, each state told a world size ``factor`` times the real one (the mean over that many)."""
    from lightning_ddpopt._groups import destroy_all_groups
    from lightning_ddpopt.hooks import CommHookState, HierarchicalState, fp16_allreduce_hook, hierarchical_hook

    tiers = _forked_2x2(rank, world_size, port, loops=True)
    magnitudes = 10.0 ** torch.linspace(-8, 2, 4001)
    signs = torch.where(torch.arange(4001) % 3 == 0, -1.0, 1.0)
    coefficients = magnitudes * signs * (1 + rank / 10)  # every rank's gradient a little different
    results = {}
    for name in ("tiers", "flat"):
        module = _Dot(4001)
        model = torch.nn.parallel.DistributedDataParallel(module)
        if name == "tiers":
            state: CommHookState = HierarchicalState(tiers=tiers, dtype=torch.float16)
            model.register_comm_hook(state, hierarchical_hook)
        else:
            state = CommHookState()
            model.register_comm_hook(state, fp16_allreduce_hook)
        state.world_size = factor * world_size
        model(coefficients).backward()
        results[name] = module.weight.grad.clone()
        del model
    exact = [torch.empty_like(coefficients) for _ in range(world_size)]
    dist.all_gather(exact, coefficients)
    torch.save({**results, "exact": sum(exact) / (factor * world_size)}, f"{out}.{rank}")
    tiers.close()
    destroy_all_groups()


@pytest.mark.quick
def test_fp16_between_nodes_does_not_underflow_at_a_large_world_size(tmp_path):
    # 4 ranks standing for 256 (a world-size factor of 64): the mean of gradients from 1e-8 to 1e2 over 256 ranks.
    out = str(tmp_path / "fp16")
    mp.start_processes(_fp16_tiers_worker, args=(4, _free_port(), out, 64), nprocs=4, start_method="fork")
    results = [torch.load(f"{out}.{rank}") for rank in range(4)]
    exact = results[0]["exact"]
    for r in results:
        torch.testing.assert_close(r["tiers"], results[0]["tiers"], rtol=0, atol=0)  # the same on every rank
    tiers, flat = results[0]["tiers"], results[0]["flat"]
    # Two tiers: the nodes agree on a power-of-two scale from the shard's peak, so every value down to 1e-6 (1e-8 of
    # the largest) crosses as a normal fp16 value: two roundings of fp16 (the cast, the sum of two nodes) at most.
    kept = exact.abs() >= 1e-6 / 256
    relative = ((tiers - exact).abs() / exact.abs())[kept]
    assert relative.max().item() < 2 * 2**-11, relative.max().item()
    assert bool((tiers != 0).all())  # nothing vanished, down to 1e-8
    # The flat fp16 hook divides by the world size before the cast: at 256 ranks everything under about 1.6e-2
    # crosses as a subnormal (fewer significant bits), and under about 8e-6 as zero, as its setup warning says.
    assert bool((flat[exact.abs() < 1e-8] == 0).all()) and not bool((flat == 0).all())
    vanishing = 2**-25 * 256  # a gradient under it is under half of fp16's smallest value once divided by 256
    magnitudes = 10.0 ** torch.linspace(-8, 2, 4001)  # each value's gradient on rank 0; rank r's is (1 + r / 10) x
    assert bool((flat[1.3 * magnitudes < vanishing] == 0).all())  # on every rank: zero
    assert bool((flat[magnitudes > 1.01 * vanishing] != 0).all())  # on none: it arrives
    note = flat_fp16_note(256)
    assert note is not None and f"lose precision and under about {vanishing:.0e} cross as zero" in note
    assert "gradients under about 2e-02 lose precision" in note  # 2^-14 x 256
    assert str(flat_fp16_note(256, chosen_by_auto=True)).startswith("ddpopt: comm_hook='auto' chose 'fp16', which")
    assert flat_fp16_note(FP16_WARN_FROM_RANKS - 1) is None


#: Two-tier PowerSGD's raw-DDP steps: loss scales (a GradScaler's growth and backoff), the overflowing step.
POWERSGD_SCALES = (1.0, 1.0, 8.0, 4.0, 4.0, 4.0, 4.0, 2.0, 2.0, 2.0, 2.0)
POWERSGD_OVERFLOW_STEP = 4
POWERSGD_RESUME_AT = 5


def _powersgd_tiers_worker(rank: int, world_size: int, port: int, out: str, loops: bool) -> None:
    """Raw DDP on 2 nodes x 2 ranks: two-tier PowerSGD, the same resumed from its state mid-way, and the reference,
    flat PowerSGD over the ranks of one local rank given the node's mean; every step's gradient and the state.
    Without ``loops``, torch's kernels in row blocks instead of numba's loops."""
    import copy

    from lightning_ddpopt._groups import destroy_all_groups
    from lightning_ddpopt.hooks import (
        HierarchicalPowerSGDState,
        PowerSGDConfig,
        PowerSGDState,
        hierarchical_powersgd_hook,
        powersgd_hook,
    )
    from lightning_ddpopt.ledger import CommLedger

    tiers = _forked_2x2(rank, world_size, port, loops)
    # Rank 1 (one 16384-element matrix at 1 above 0.05): the error is measured at sync 6 and the rank doubles at sync 8.
    # Local rank 0 owns the large matrix; local rank 1 the rest, none worth compressing at this rate: it compresses
    # nothing and still takes part in the measurement.
    config = PowerSGDConfig(rank=1, max_error=0.05, max_rank=4, start_iter=2, min_compression_rate=20)
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    data = torch.Generator().manual_seed(rank)
    inputs = []
    for step in range(len(POWERSGD_SCALES)):
        batch = torch.randn(8, 256, generator=data) * (100.0 if rank == step % world_size else 1.0)
        if step == POWERSGD_OVERFLOW_STEP and rank == 2:
            batch[0, 0] = math.inf
        inputs.append(batch)
    scale = torch.ones(())

    def node_mean_then_flat(state, bucket):
        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=tiers.intra)
        buffer.div_(2)
        return powersgd_hook(state, bucket)

    def run(kind: str, steps: range, saved: dict | None = None) -> tuple[list, PowerSGDState, CommLedger]:
        module = copy.deepcopy(initial)
        ledger = CommLedger(error_every=1)
        if kind == "tiers":
            state: PowerSGDState = HierarchicalPowerSGDState(
                config=config, tiers=tiers, ledger=ledger, loss_scale=lambda: scale, pipelined=True
            )
            model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.01)
            hook = hierarchical_powersgd_hook
        else:
            state = PowerSGDState(config=config, process_group=tiers.cross, ledger=ledger, loss_scale=lambda: scale)
            model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.01, process_group=tiers.cross)
            hook = node_mean_then_flat
        state.bind_module(module)
        if saved is not None:
            state.load_state_dict(saved)
        model.register_comm_hook(state, ledger.record_hook(hook))
        grads = []
        for step in steps:
            scale.fill_(POWERSGD_SCALES[step])
            model.zero_grad()
            (model(inputs[step]).pow(2).mean() * POWERSGD_SCALES[step]).backward()
            ledger.close_step()
            grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
            if saved is None and kind == "tiers" and step == POWERSGD_RESUME_AT - 1:
                resume_from.append(copy.deepcopy(state.state_dict()))
        state.state_dict()  # the last round committed
        state.close()
        index = {id(p): i for i, p in enumerate(module.parameters())}
        members.append([[index[id(p)] for p in b.parameters()] for b in model.reducer._get_zeros_like_grad_buckets()])
        return grads, state, ledger

    resume_from: list[dict] = []
    members: list[list[list[int]]] = []  # DDP's buckets at the end of each run: the parameters' indices in each
    results = {}
    for kind in ("tiers", "flat"):
        grads, state, ledger = run(kind, range(len(POWERSGD_SCALES)))
        results[kind] = {
            "grads": grads,
            "errors": dict(state.errors),
            "q": dict(state.q_memories),
            "skipped": state.skipped_rounds,
            "rank_changes": [(step, old, new) for step, _, old, new, _ in state.rank_changes],
            "bytes": [(s.wire_bytes, s.intra_node_bytes) for s in ledger.steps],
            "config": state.state_dict()["config"],
            "owners": getattr(state, "owners", None),
        }
    grads, state, _ = run("tiers", range(POWERSGD_RESUME_AT, len(POWERSGD_SCALES)), saved=resume_from[0])
    results["resumed"] = {"grads": grads, "errors": dict(state.errors), "q": dict(state.q_memories)}
    results["shapes"] = [tuple(p.shape) for p in initial.parameters()]
    results["buckets"] = members[0]
    torch.save(results, f"{out}.{rank}")
    tiers.close()
    destroy_all_groups()


def _powersgd_intra_bytes(
    owners: dict[str, int], shapes: list[tuple], buckets: list[list[int]], config: PowerSGDConfig | None, rank: int
) -> int:
    """Two-tier PowerSGD's intra-node bytes per step: per bucket, M x the widest owner's elements (the all-to-all)
    and the widest owner's payload (P and Q of each compressed matrix at ``rank``, the values of the rest; ``config``
    ``None``: before ``start_iter``, every value)."""
    names, per_node = list(owners), max(owners.values()) + 1
    total = 0
    for bucket in buckets:
        elements, payload = [0] * per_node, [0] * per_node
        for index in bucket:
            shape, owner = shapes[index], owners[names[index]]
            elements[owner] += math.prod(shape)
            compressed = config is not None and len(shape) == 2 and config.compresses(shape[0], shape[1], rank)
            payload[owner] += (shape[0] + shape[1]) * min(rank, *shape) if compressed else math.prod(shape)
        total += 4 * (per_node * max(elements) + max(payload))
    return total


@pytest.mark.quick
@pytest.mark.parametrize("loops", [True, False], ids=["numba", "torch"])
def test_powersgd_in_two_tiers_is_flat_powersgd_over_the_node_means(tmp_path, loops):
    if loops:
        pytest.importorskip("numba")
    out = str(tmp_path / "powersgd")
    mp.start_processes(_powersgd_tiers_worker, args=(4, _free_port(), out, loops), nprocs=4, start_method="fork")
    results = [torch.load(f"{out}.{rank}") for rank in range(4)]
    steps = len(POWERSGD_SCALES)
    for rank, r in enumerate(results):
        tiers, flat = r["tiers"], r["flat"]
        # Every rank, every step: the same bits as flat PowerSGD between the nodes given each node's mean (the
        # matrices this rank owns compressed here, the others by their owners), and the same on every rank.
        for step in range(steps):
            a, b = tiers["grads"][step], flat["grads"][step]
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"rank {rank}, step {step}")
            torch.testing.assert_close(a, results[0]["tiers"]["grads"][step], rtol=0, atol=0, equal_nan=True)
        # The overflow reached every rank, and no rank committed that round; the rank doubled at the same sync.
        assert not tiers["grads"][POWERSGD_OVERFLOW_STEP].isfinite().all()
        assert tiers["skipped"] == flat["skipped"] == 1
        assert tiers["rank_changes"] == flat["rank_changes"] == [(8, 1, 2)]
        # Error feedback and Q memories for what this rank owns only, bit for bit the reference's.
        owned = {name for name, owner in tiers["owners"].items() if owner == rank % 2}
        assert set(tiers["errors"]) == set(tiers["q"]) == set(flat["errors"]) & owned
        for name in tiers["errors"]:
            torch.testing.assert_close(tiers["errors"][name], flat["errors"][name], rtol=0, atol=0)
            torch.testing.assert_close(tiers["q"][name], flat["q"][name], rtol=0, atol=0)
        assert tiers["config"]["tiers"] == "2 nodes x 2 ranks: [[0, 1], [2, 3]]" and flat["config"]["tiers"] is None
        # Resumed from the state after step 5 (a fresh DDP model, its first buckets another layout): bit for bit.
        resumed = r["resumed"]
        for step, grad in enumerate(resumed["grads"], start=POWERSGD_RESUME_AT):
            torch.testing.assert_close(grad, tiers["grads"][step], rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
        for name in tiers["errors"]:
            torch.testing.assert_close(resumed["errors"][name], tiers["errors"][name], rtol=0, atol=0)
        # Inside the node the all-to-all to the owners (the widest owner's share, to each rank) and the gather of
        # the widest payload (factors and exact values); between nodes the factors and exact tensors of what this
        # rank owns: a node's two ranks send what the reference sends, between them.
        owners, config = tiers["owners"], PowerSGDConfig(rank=1, min_compression_rate=20)
        expected = [
            _powersgd_intra_bytes(
                owners, r["shapes"], r["buckets"], config if step >= 2 else None, 2 if step >= 8 else 1
            )
            for step in range(steps)  # compressing from sync 2, the rank doubled at sync 8
        ]
        assert [intra for _, intra in tiers["bytes"]][1:] == expected[1:]  # from the first rebuild of DDP's buckets
    for node in (results[:2], results[2:]):
        for step in range(steps):
            assert sum(r["tiers"]["bytes"][step][0] for r in node) == node[0]["flat"]["bytes"][step][0], step
    # Local rank 0 owns the large matrix; local rank 1 the rest; the payloads gathered are factors, not gradients.
    assert results[0]["tiers"]["owners"] == {"0.weight": 0, "0.bias": 1, "2.weight": 1, "2.bias": 1}
    assert set(results[0]["tiers"]["errors"]) == {"0.weight"} and not results[1]["tiers"]["errors"]


@pytest.mark.slow
def test_fabric_on_two_nodes_syncs_in_two_tiers_with_its_ranks_spawned(tmp_path):
    # Each node's process starts Fabric with NODE_RANK set; Fabric's spawn launcher starts the node's two ranks.
    _run_nodes(tmp_path, 2, 2, [], fabric=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(4)]
    assert [r["rank"] for r in ranks] == [(0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 4), (3, 1, 1, 4)]
    for r in ranks:
        # "auto": int8 in two tiers; every rank ends with the same parameters, bit for bit.
        assert (r["hook"], r["state"]) == ("int8", "HierarchicalInt8State")
        for mine, first in zip(r["params"], ranks[0]["params"], strict=True):
            assert torch.equal(mine, first)
        # One sync per step of two micro-batches (no_backward_sync), both tiers counted every step.
        assert [s["sync_rounds"] for s in r["steps"]] == [1] * 8
        assert all(0 < s["wire"] < s["logical"] / 4 for s in r["steps"]) and all(b > 0 for b in r["intra"])
        # Rank 1's overflow at step 3 reached every rank through both tiers: each GradScaler found it in the synced
        # gradients, skipped that step and halved its scale once.
        assert r["scale"] == 2.0**9
    metrics = ranks[0]["metrics"]
    last = ranks[0]["steps"][-4:]
    assert metrics["ddpopt/comm/bytes_sent_intra_node"] == pytest.approx(sum(ranks[0]["intra"][-4:]) / 4)
    assert metrics["ddpopt/comm/bytes_sent"] == pytest.approx(sum(s["wire"] for s in last) / 4)
    report = json.loads(Path(ranks[0]["report"]).read_text())
    assert [f["area"] for f in report["findings"]] == ["network", "compression", "amp", "accumulation", "stragglers"]
