"""Two-tier int8 sync for N nodes x M ranks: fp32 inside a node, int8 between nodes, 1/M of the bucket per rank.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

Each bucket's sync, on every rank (the groups are :class:`lightning_ddpopt.topology.TierGroups`'):

1. **inside the node**, in fp32: every rank sends each local rank the blocks that rank owns (one ``all_to_all``),
   and each rank sums what it received in local-rank order: the node's sum of its shard (a reduce-scatter whose
   summation order does not depend on where a block sits in the bucket);
2. **between the nodes**: the shard, plus this rank's error feedback and divided by the world size, is quantised to
   int8 blocks (:mod:`lightning_ddpopt.hooks.int8_codec`'s format) and reduced over the N ranks of the same local
   rank, one per node, the way the flat int8 hook reduces over every rank (``all_to_all`` of the quantised chunks,
   each owner sums its chunk in node order and re-quantises it, ``all_gather``);
3. **inside the node**: the reduced shards, still int8, are all-gathered and dequantised into the bucket.

Only the quantised shard crosses nodes: each node's link carries ``2 (N-1)/N`` of a quarter of the bucket (M shards
in parallel), where the flat int8 hook puts ``2 (NM-1)/NM`` of it on the link from *every* rank. Every rank ends
with the same bucket, bit for bit (the same int8 bytes dequantised the same way).

Which local rank owns a block depends on the parameter alone, never on DDP's buckets: a parameter's blocks of
``block_size`` elements (each parameter starts a new block, as in the flat hook) are split into M contiguous runs,
and run ``r`` goes to local rank ``(r + first block of the parameter in the model) mod M``. So the error feedback, kept
per parameter for the blocks this rank owns (1/M of the flat hook's memory), the quantisation and the sums are the
same bits whatever DDP's bucket layout: a resume is bit-exact although DDP's first buckets after it differ from the
rebuilt ones before the checkpoint.

The ledger counts the packed shard (payload and scales, padding included) as the hook's wire bytes, the bytes that
cross nodes, and the fp32 blocks of the first ``all_to_all`` (the bucket, padded to whole blocks and to equal
shards) as the intra-node bytes. A block holding an inf or NaN gets a non-finite scale: every rank dequantises it,
every rank's round sees it (the scales checked are the gathered ones, the same everywhere) and no rank commits that
round's errors (:mod:`lightning_ddpopt.hooks.base`).

On a CPU the three stages are a pipeline (:class:`~lightning_ddpopt.hooks._worker.TierStages`): a thread and
a group each; with numba the quantisation with error feedback and the dequantisation into the bucket are the flat
hook's fused loops (:mod:`lightning_ddpopt.hooks._kernels`). On CUDA the stages are issued in the hook call on a
side stream. Memory beyond DDP's buckets, per bucket in flight: the padded bucket twice in fp32 (sent and received
inside the node) and its int8 gather, O(P); the shard's errors (committed and being written), O(P / M).

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

import math
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks._worker import TierStages, run_all
from lightning_ddpopt.hooks.base import CommHookState, SyncRound, TwoTierForm, add_feedback, fed_back_sq, squared_norm
from lightning_ddpopt.hooks.int8 import Int8State
from lightning_ddpopt.hooks.int8_codec import (
    all_gather_async,
    dequantize_blocks,
    quantize_into,
    reduce_and_requantize,
    unpack,
)
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.topology import TierGroups

__all__ = ["HierarchicalInt8State", "hierarchical_int8_hook", "int8_form"]


@dataclass(kw_only=True)
class HierarchicalInt8State(Int8State):
    """The state of :func:`hierarchical_int8_hook`: the int8 config and error feedback, and the tiers' groups.

    The strategy builds it from ``comm_hook="int8"`` (or an :class:`~lightning_ddpopt.hooks.Int8Config`) on a
    hierarchical run; build one yourself only to register the hook on a DDP model of your own, then call
    :meth:`bind_module` with the wrapped module.

    Args:
        tiers: the intra- and cross-node groups.
        config: block size and error feedback.
        process_group: the model's group (its size is the world size the gradients are averaged over).
        ledger: where the hook reports its bytes; ``None`` records nothing.
        loss_scale: returns the current loss scale (the strategy sets it under fp16 AMP).
        iteration: sync rounds so far (restored from a checkpoint; leave it 0).
        skipped_rounds: rounds whose reduced values were not finite and left the state untouched.
        errors: this rank's error feedback per parameter name, for the blocks it owns (saved in checkpoints).
        error_scales: the loss scale each error was computed at.
        exchange_group: unused: the tiers' groups carry every stage.
    """

    label: ClassVar[str] = "int8"

    tiers: TierGroups | None = field(default=None, repr=False)
    #: Each parameter's first block in the model (the blocks' owners follow from it).
    _first_blocks: dict[str, int] = field(default_factory=dict, repr=False)
    _layouts: "dict[tuple[str, ...], _Layout]" = field(default_factory=dict, repr=False)
    stages: TierStages = field(default_factory=lambda: TierStages("ddpopt-hierarchical-int8"), init=False, repr=False)
    #: The bucket layouts of the round now open: the others' buffers are dropped when the next round opens.
    _used: set[tuple[str, ...]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiers is None:
            raise ValueError("HierarchicalInt8State needs tiers= (the intra- and cross-node groups)")
        topology = self.tiers.topology
        self.ranks_per_node, self.num_nodes = topology.ranks_per_node, topology.num_nodes
        self.local_rank = topology.local_rank

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names and where each parameter's blocks start in the model.

        Args:
            module: the module DDP wraps.
        """
        super().bind_module(module)
        first = 0
        self._first_blocks, self._layouts = {}, {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                self._first_blocks[name] = first
                first += math.ceil(param.numel() / self.config.block_size)

    def config_dict(self) -> dict[str, object]:
        """The Int8Config and the tiers (every node's ranks), as saved: errors of another layout do not apply."""
        assert self.tiers is not None
        return {**asdict(self.config), "tiers": self.tiers.topology.layout()}

    def close(self) -> bool:
        """Stop the stages' threads (see :meth:`~lightning_ddpopt.hooks._worker.TierStages.close`)."""
        return self.stages.close()

    def state_dict(self) -> dict[str, object]:
        """The step counter and error feedback, once every bucket handed in has been through every stage."""
        self.stages.drain()
        return super().state_dict()

    def layout(self, names: list[str], numels: list[int]) -> "_Layout":
        """Where the bucket's blocks go (made once per bucket layout).

        Args:
            names: the bucket's parameter names, in DDP's order.
            numels: their sizes.
        """
        key = tuple(names)
        self._used.add(key)
        found = self._layouts.get(key)
        if found is None:
            params = [(n, numel, self._first_blocks[n]) for n, numel in zip(names, numels, strict=True)]
            found = self._layouts[key] = _Layout(
                params, self.config.block_size, self.ranks_per_node, self.num_nodes, self.local_rank
            )
        return found


class _Layout:
    """A bucket's blocks by owner: the runs copied into each local rank's shard, and this rank's own runs.

    ``copies``: ``(parameter, owner, first slot, first element, end element)`` per run, a slot being a block of the
    owner's shard; ``mine``: ``(name, first slot, blocks)`` of this rank's runs; ``shard_blocks``: blocks per shard
    (every owner's padded to the most, and to a multiple of the nodes for the exchange between them).
    """

    def __init__(self, params: list[tuple[str, int, int]], block: int, owners: int, nodes: int, own: int) -> None:
        self.copies: list[tuple[int, int, int, int, int]] = []
        self.mine: list[tuple[str, int, int]] = []
        used = [0] * owners
        for index, (name, numel, first) in enumerate(params):
            blocks = math.ceil(numel / block)
            for owner in range(owners):
                run = (owner - first) % owners  # the parameter's run this owner takes: small ones spread out
                start, end = run * blocks // owners, (run + 1) * blocks // owners
                if end == start:
                    continue
                self.copies.append((index, owner, used[owner], start * block, min(end * block, numel)))
                if owner == own:
                    self.mine.append((name, used[owner], end - start))
                used[owner] += end - start
        self.used = used
        self.shard_blocks = max(1, math.ceil(max(used) / nodes)) * nodes
        self.per_node = self.shard_blocks // nodes
        self.block = block
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer for ``purpose``, kept for this bucket's next steps.

        A fresh bucket-sized allocation each step costs more than the arithmetic (the kernel hands large blocks out
        zeroed, page by page). A bucket's sync is done before DDP hands it in again, and each bucket has a layout
        (and buffers) of its own.
        """
        found = self._buffers.get(purpose)
        if found is None or found.shape != shape or found.dtype != dtype or found.device != device:
            found = self._buffers[purpose] = torch.empty(shape, dtype=dtype, device=device)
        return found


def hierarchical_int8_hook(state: HierarchicalInt8State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank in two tiers: fp32 inside each node, int8 between nodes.

    Args:
        state: a :class:`HierarchicalInt8State`.
        bucket: the gradient bucket DDP hands the hook.
    """
    state.stages.check()  # before anything is recorded or opened: an earlier bucket failed
    start = time.perf_counter()
    buffer = bucket.buffer()
    if bucket.index() == 0:
        if state._round is not None:
            # Left over from a backward pass that raised before its last bucket: start this round afresh.
            state.stages.drain()
            state._round = None
        # The buckets DDP used before its rebuild are not handed in again: free their buffers.
        state._layouts = {key: state._layouts[key] for key in state._used if key in state._layouts}
        state._used = set()
    sync = _Int8TierSync(state, state.open_round(), bucket)
    state.add_seconds(time.perf_counter() - start)
    if buffer.is_cuda:

        def chain() -> torch.futures.Future[torch.Tensor]:
            future = run_all(sync)
            if bucket.is_last():
                state.close_round(seal_now=True)  # every bucket's stages ran in stream order
            return future

        return state._streams.run(buffer, chain)
    if bucket.is_last():
        # The buckets finish on the stages' threads: the round is judged once DDP has waited for every bucket, when
        # the next round opens or the state is saved.
        state.close_round(seal_now=False)
    return state.stages.run(state, sync, bucket.index())


class _Int8TierSync:
    """One bucket's three stages (a :class:`~lightning_ddpopt.hooks._worker.TierSync`)."""

    def __init__(self, state: HierarchicalInt8State, round_: SyncRound, bucket: dist.GradBucket) -> None:
        self.state, self.round, self.bucket = state, round_, bucket
        self.buffer = bucket.buffer()
        self.names, self.gradients = state.names_in(bucket), [g.view(-1) for g in bucket.gradients()]
        layout = self.layout = state.layout(self.names, [g.numel() for g in self.gradients])
        self.measuring = state.measuring
        shard = layout.shard_blocks * layout.block
        # (node sum + error) / world size, then the new errors: in the error buffer kept from the round before last
        if state.config.error_feedback:
            self.values = state.error_buffer(round_, "|".join(self.names), (shard,), torch.float32, self.buffer.device)
        else:
            self.values = layout.buffer("values", (shard,), torch.float32, self.buffer.device)
        self.loops = _kernels.available() and _kernels.fits(self.buffer.view(1, -1))  # fp32 on a CPU
        self.send: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None
        state.record_wire_bytes(bucket, layout.shard_blocks * (layout.block + 4))
        state.record_wire_bytes(bucket, state.ranks_per_node * shard * 4, intra_node=True)

    def reduce_inside(self) -> None:
        """Send each local rank its blocks in fp32; sum this rank's shard over the node, in local-rank order."""
        state, layout = self.state, self.layout
        block, shard = layout.block, layout.shard_blocks * layout.block
        device = self.buffer.device
        outgoing = layout.buffer("outgoing", (state.ranks_per_node, shard), torch.float32, device)
        for index, owner, slot, start, end in layout.copies:
            at = slot * block
            outgoing[owner, at : at + end - start].copy_(self.gradients[index][start:end])
            if (end - start) % block:  # the padding of the parameter's last block
                outgoing[owner, at + end - start : at + math.ceil((end - start) / block) * block].zero_()
        for owner, used in enumerate(layout.used):  # the shard's padding to equal shards
            outgoing[owner, used * block :].zero_()
        incoming = layout.buffer("incoming", (state.ranks_per_node, shard), torch.float32, device)
        state.wait(dist.all_to_all_single(incoming, outgoing, group=state.tiers.intra, async_op=True))  # type: ignore[union-attr]
        node_sum = incoming[0]
        for contribution in incoming[1:]:  # in local-rank order: the same bits whatever the bucket layout
            node_sum.add_(contribution)
        self.send = self._quantize(node_sum)

    def _quantize(self, node_sum: torch.Tensor) -> torch.Tensor:
        """``(node sum + error) / world size`` as int8 chunks, one per node; the new errors into the round."""
        state, layout, round_, values = self.state, self.layout, self.round, self.values
        block, per_node, world = layout.block, layout.per_node, state.world_size
        feedback = state.config.error_feedback
        send = layout.buffer("send", (state.num_nodes, per_node * block + 4 * per_node), torch.int8, node_sum.device)

        def runs(tensor: torch.Tensor) -> list[torch.Tensor]:
            """This rank's runs of blocks in ``tensor`` (one per parameter, in :attr:`_Layout.mine`'s order)."""
            return [tensor[slot * block : (slot + blocks) * block] for _, slot, blocks in layout.mine]

        names = [name for name, _, _ in layout.mine]
        found = [
            state.stored_error(round_, name, part) if feedback else None
            for name, part in zip(names, runs(node_sum), strict=True)
        ]
        given_sq = None
        if self.measuring:  # the node's sum with the errors added
            given = node_sum.clone()
            add_feedback(runs(given), found)
            given_sq = squared_norm(given)
        if self.loops:
            scales = torch.zeros(state.num_nodes, per_node, dtype=torch.float32)
            mine = sum(blocks for _, _, blocks in layout.mine)
            padding = ("", mine, layout.shard_blocks - mine)  # the zero padding: zero bytes, zero scales
            for (_, slot, blocks), stored in zip([*layout.mine, padding], [*found, None], strict=True):
                if blocks == 0:
                    continue
                part = slice(slot * block, (slot + blocks) * block)
                errors = values[part] if feedback or self.measuring else None
                _kernels.quantize_parameter(node_sum[part], stored, world, slot, errors, send, scales, block)
            send[:, per_node * block :].copy_(scales.view(torch.int8))
        else:
            add_feedback(runs(node_sum), found)
            torch.div(node_sum, world, out=values)
            rows = values.view(-1, block)
            dequantized = quantize_into(rows, send, per_node * block)
            if feedback or self.measuring:
                rows.sub_(dequantized).view(-1).mul_(world)
        if feedback:
            round_.errors.update(zip(names, runs(values), strict=True))
        if given_sq is not None:
            state.record_compression(self.bucket, given_sq, squared_norm(values), fed_back_sq(found))
        return send

    def reduce_between(self) -> None:
        """The quantised shard's mean over the nodes: each node's rank reduces its chunk, then all gather."""
        state, layout, send = self.state, self.layout, self.send
        assert send is not None
        cross = state.tiers.cross  # type: ignore[union-attr]
        received = layout.buffer("received", send.shape, torch.int8, send.device)
        state.wait(dist.all_to_all_single(received, send, group=cross, async_op=True))
        own = reduce_and_requantize(received, layout.per_node * layout.block, layout.block, loops=self.loops)
        gathered = layout.buffer("gathered", send.shape, torch.int8, send.device)
        state.wait(all_gather_async(gathered.view(-1), own.view(-1), cross))
        self.gathered = gathered

    def gather(self) -> None:
        """Every local rank's reduced shard, in int8, from the node's ranks; dequantised into the bucket."""
        state, layout, gathered = self.state, self.layout, self.gathered
        assert gathered is not None
        block, per_node = layout.block, layout.per_node
        shape = (state.ranks_per_node, *gathered.shape)
        everything = layout.buffer("everything", shape, torch.int8, gathered.device)
        state.wait(all_gather_async(everything.view(-1), gathered.view(-1), state.tiers.intra_gather))  # type: ignore[union-attr]
        chunk = per_node * block
        payloads, scales = unpack(everything.view(-1, gathered.shape[1]), chunk)
        payloads = payloads.view(state.ranks_per_node, state.num_nodes, chunk)
        self.round.check([scales])
        scales = scales.view(state.ranks_per_node, state.num_nodes, per_node)
        if self.loops:
            for index, owner, slot, start, end in layout.copies:
                target = self.gradients[index][start:end]
                _kernels.dequantize_parameter(everything[owner], scales[owner], slot, target, block)
            return
        shards = [
            dequantize_blocks(payloads[owner].reshape(-1, block), scales[owner].reshape(-1)).view(-1)
            for owner in range(state.ranks_per_node)
        ]
        for index, owner, slot, start, end in layout.copies:
            self.gradients[index][start:end].copy_(shards[owner][slot * block : slot * block + end - start])

    def abandon(self) -> None:
        """A stage failed: never commit this round's errors."""
        self.round.check([torch.tensor(math.nan, device=self.buffer.device)])


def _two_tier_state(
    *, flat: CommHookState, tiers: TierGroups, process_group: dist.ProcessGroup, ledger: CommLedger, **_: object
) -> CommHookState:
    assert isinstance(flat, Int8State)
    return HierarchicalInt8State(config=flat.config, tiers=tiers, process_group=process_group, ledger=ledger)


def int8_form() -> TwoTierForm:
    """int8's two-tier form (:mod:`~lightning_ddpopt.hooks.hierarchical_int8`), with the flat state's config."""
    return TwoTierForm(hierarchical_int8_hook, _two_tier_state, "int8 blocks")
