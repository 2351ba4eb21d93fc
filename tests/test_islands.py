"""Local SGD islands on nodes x ranks: gradients sync inside each island every step, the islands' parameters every
H steps, the outer state sharded over an island's ranks; int8 and overlap across the islands; bit-exact resume.

The ranks start as on a cluster: one process per "node" with ``NODE_RANK`` (tests/islands_worker.py), Lightning
starts that node's other ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ddpopt import LocalSGDConfig
from lightning_ddpopt.checkpoint import read_saved_run
from lightning_ddpopt.hooks.int8_codec import packed_size
from lightning_ddpopt.localsgd.config import OUTER_DEFAULTS
from lightning_ddpopt.localsgd.islands import plan_islands
from lightning_ddpopt.topology import Topology
from tests.helpers import StackModel
from tests.islands_worker import OVERFLOW_RANK
from tests.test_hierarchical import _records, _run_nodes

PARAMETERS = 6 * (256 * 256 + 256)


def _islands(nodes: int, per_node: int) -> list[list[int]]:
    return [list(range(node * per_node, (node + 1) * per_node)) for node in range(nodes)]


def _outer_step(anchor: torch.Tensor, before: list[torch.Tensor], momentum: torch.Tensor) -> torch.Tensor:
    """DiLoCo's outer step on the islands' mean change: Nesterov SGD at ``diloco()``'s outer settings for an SGD inner
    optimizer (``momentum`` in place)."""
    lr, beta = OUTER_DEFAULTS["other"]
    mean = sum(anchor - p for p in before) / len(before)
    momentum.mul_(beta).add_(mean)
    return anchor - lr * (mean + beta * momentum)


@pytest.mark.parametrize(
    ("nodes", "per_node"), [pytest.param(2, 2, id="2x2"), pytest.param(3, 2, id="3x2", marks=pytest.mark.slow)]
)
def test_islands_train_as_replicas_of_a_node(tmp_path, nodes, per_node):
    resumes = ["resume_full", "resume_half", "islands_to_ranks", "ranks_save", "ranks_to_islands"]
    resumes += ["overlap_full", "overlap_half"]
    fits = ["diloco", "int8_overlap"] + (["warmup", *resumes] if nodes == 2 else [])
    output = _run_nodes(tmp_path, nodes, per_node, fits, worker="tests.islands_worker", timeout=600)
    world, islands = nodes * per_node, _islands(nodes, per_node)
    # Said once per fit, with the layout and the reason.
    said = f"ddpopt: local SGD replicas: {nodes} replicas x {per_node} ranks ({islands}); replica='auto': a replica"
    auto = len([fit for fit in fits if fit not in resumes or fit.startswith("overlap")])
    assert output.count(said + f" per node on {nodes} nodes x {per_node} ranks") == auto, output[-3000:]
    assert output.count(said.replace("'auto': a replica", "'node'")) == (3 if nodes == 2 else 0)
    assert "replica per node on" in output
    # The island's ranks share a host: the outer step's shards meet in its shared memory, not through gloo.
    assert "ddpopt: local SGD islands gather the outer step's shards through the host's shared memory" in output
    assert "shards through gloo" not in output

    ranks = _records(tmp_path, "diloco", world)
    # Inside an island the parameters are identical after every step (its gradients sync); the islands are
    # identical right after each sync (3, 6) and after the final average, apart in between.
    for step in range(8):
        for island in islands:
            for rank in island[1:]:
                assert torch.equal(ranks[rank]["params"][step], ranks[island[0]]["params"][step]), (step, rank)
        apart = [ranks[island[0]]["params"][step] for island in islands]
        assert all(torch.equal(apart[0], other) for other in apart[1:]) == (step + 1 in (3, 6)), step
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
    # After fit every rank holds the whole anchor (a checkpoint saved then, with the island's groups gone).
    assert all(torch.equal(r["anchor"], ranks[0]["final"]) for r in ranks)
    # The outer step: Nesterov SGD on the mean of the islands' changes (fp32), one change per island.
    # (The overflowing island skipped step 6's inner step, and its optimizer's hooks with it: it carried step 5's.)
    anchor, momentum = ranks[0]["start"], torch.zeros(PARAMETERS)
    for sync in (3, 6):
        before = [ranks[i[0]]["before_sync"].get(sync, ranks[i[0]]["params"][sync - 2]) for i in islands]
        assert len([i for i in islands if sync not in ranks[i[0]]["before_sync"]]) == (sync == 6)
        anchor = _outer_step(anchor, before, momentum)
        torch.testing.assert_close(ranks[0]["params"][sync - 1], anchor, rtol=0, atol=2e-6)
        anchor = ranks[0]["params"][sync - 1]
    # Rank OVERFLOW_RANK's loss overflowed at steps 2 and 6: the island's sync carried the inf to its other rank,
    # so both skipped those steps; the other islands none.
    for r in ranks:
        skipped = 2 if OVERFLOW_RANK in islands[r["rank"] // per_node] else 0
        assert (r["skipped_inner"], r["amp"]["skipped_steps"]) == (skipped, skipped), r["rank"]
    # Each island rank owns 1/M of the parameters for the outer step: the anchor and momentum of its shard only.
    shard = math.ceil(PARAMETERS / per_node)
    for r in ranks:
        local = r["rank"] % per_node
        start, stop = local * shard, min(PARAMETERS, (local + 1) * shard)
        assert r["shard"] == (start, stop)
        assert r["sizes"] == {
            "anchor": stop - start,
            "momentum": stop - start,
            "work": shard,
            "int8": None,
            "full": per_node * shard,  # the island's gather, into the whole model
        }
        # Every step: the gradients inside the island (fp32, all of them), nothing across; at a sync this rank's
        # shard of the change, in fp32, across the islands.
        for step, (_, logical, wire, intra) in enumerate(r["steps"], start=1):
            crossing = (stop - start) * 4 if step in (3, 6) else 0
            assert (logical, wire, intra) == (PARAMETERS * 4 + crossing, crossing, PARAMETERS * 4), step
        assert r["stragglers"]["last"] is not None and "bytes_sent" in r["comm"]
    # int8 across the islands, travelling for 2 steps, mixing 0: every rank takes the new anchor at step 6.
    ranks = _records(tmp_path, "int8_overlap", world)
    # The first step inside an island: SGD (lr 0.05; its momentum starts as the gradient) on the mean of the island
    # ranks' gradients of their own batches, not their sum, nor every rank's mean.
    model = StackModel()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(ranks[0]["start"], model.parameters())
    for island in islands:
        gradients = []
        for rank in island:
            model.zero_grad()
            x, y = ranks[rank]["first_batch"]
            torch.nn.functional.mse_loss(model.net(x), y).backward()
            gradients.append(torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters()))
        expected = ranks[0]["start"] - 0.05 * sum(gradients) / len(island)
        torch.testing.assert_close(ranks[island[0]]["params"][0], expected, rtol=0, atol=1e-6)
    # Its float buffer (each rank adds rank + 1 a step) is averaged over every rank when the sync is applied.
    for step in range(8):
        values = [r["buffers"][step][0] for r in ranks]
        expected_values = [6 * (world + 1) / 2] * world if step + 1 == 6 else values
        assert values == pytest.approx(expected_values), step
        assert (len(set(values)) == 1) == (step + 1 == 6), (step, values)
    for step in range(8):
        for island in islands:
            for rank in island[1:]:
                assert torch.equal(ranks[rank]["params"][step], ranks[island[0]]["params"][step]), (step, rank)
        apart = [ranks[island[0]]["params"][step] for island in islands]
        assert all(torch.equal(apart[0], other) for other in apart[1:]) == (step + 1 == 6), step
    anchor = _outer_step(ranks[0]["start"], [ranks[i[0]]["before_sync"][4] for i in islands], torch.zeros(PARAMETERS))
    error = (ranks[0]["params"][5] - anchor).abs().max().item()
    assert 0 < error < 5e-3, error  # quantised to int8 twice: by each island, and the owner's sum
    # The int8 shard in whole blocks, one chunk per island; the buffers are each a byte per value of the shard.
    shard = math.ceil(PARAMETERS / (per_node * nodes * 1024)) * nodes * 1024
    row = packed_size(shard // nodes, 1024)
    for r in ranks:
        local = r["rank"] % per_node
        stop = min(PARAMETERS, (local + 1) * shard)
        assert r["sizes"]["anchor"] == stop - local * shard and r["sizes"]["work"] == shard
        assert r["sizes"]["int8"] == [(nodes, row)] * 3
        # Applied at step 6: the packed shard (the size of an all-reduce with its traffic), and the 4-byte buffer.
        assert r["steps"][5][2] == nodes * row + 4
    if nodes == 2:
        # Two synchronous steps through the strategy's two-tier int8 hook: every rank alike, int8 crossing the nodes.
        # Then islands: inside them every step, and plain averages across them at steps 5 and 8 (identical).
        ranks = _records(tmp_path, "warmup", world)
        for step in range(8):
            for island in islands:
                for rank in island[1:]:
                    assert torch.equal(ranks[rank]["params"][step], ranks[island[0]]["params"][step]), (step, rank)
            alike = all(torch.equal(ranks[0]["params"][step], r["params"][step]) for r in ranks)
            assert alike == (step + 1 in (1, 2, 5, 8)), step
        for r in ranks:
            for step, (_, _, wire, intra) in enumerate(r["steps"], start=1):
                if step <= 2:  # a byte per value of this rank's half between the nodes (and scales), fp32 inside
                    assert PARAMETERS / 2 < wire < PARAMETERS / 2 * 1.05 and intra > PARAMETERS * 4, (step, wire)
                else:
                    assert intra == PARAMETERS * 4 and wire == (r["sizes"]["anchor"] * 4 if step in (5, 8) else 0)
        assert output.count("sent between nodes in int8 blocks") == 1
        # Resumed at the first epoch's end (a sync), every rank ends bit for bit where the uninterrupted run did:
        # the anchor and outer momentum saved whole, Adam's state once per island.
        fulls, resumed_runs = _records(tmp_path, "resume_full", world), _records(tmp_path, "resume_half", world)
        for full, resumed in zip(fulls, resumed_runs, strict=True):
            torch.testing.assert_close(resumed["final"], full["final"], rtol=0, atol=0)
        path = tmp_path / "resume" / "epoch=0.ckpt"
        entry = torch.load(path, weights_only=True)["ddpopt"]
        assert entry["local_sgd"]["anchor"] is None and not entry["local_sgd_ranks"]  # nothing whole on rank 0
        saved = read_saved_run(path)
        assert saved is not None and saved.shards is not None and saved.local_sgd is not None
        outer = saved.local_sgd
        assert outer["anchor"].numel() == outer["momentum"].numel() == PARAMETERS
        # The first island's ranks wrote their slices; each island's first rank its Adam state.
        assert saved.shards["outer_slices"] == [list(r["shard"]) for r in resumed_runs[: len(islands[0])]]
        assert saved.shards["inner_owners"] == [island[0] for island in islands for _ in island]
        stored = {name for name in saved.reader.names() if name.endswith("/skeleton")}
        assert stored == {f"inner/{island[0]}/skeleton" for island in islands}
        # Each rank resumed its shard of the saved anchor.
        for r in resumed_runs:
            start, stop = r["shard"]
            assert torch.equal(r["anchor_at_start"], outer["anchor"][start:stop])
        # Resumed from the same checkpoint with a replica per rank: each rank's anchor is the saved slices end to end.
        for r in _records(tmp_path, "islands_to_ranks", world):
            assert r["shard"] == (0, PARAMETERS) and torch.equal(r["anchor_at_start"], outer["anchor"][:])
        # Saved with a replica per rank (four Adam states), resumed as islands: each island takes its first rank's
        # Adam state, and its ranks stay identical after every step.
        ranks = _records(tmp_path, "ranks_to_islands", world)
        saved_by_ranks = torch.load(tmp_path / "ranks" / "epoch=0.ckpt", weights_only=False)["ddpopt"]["local_sgd"]
        for r in ranks:
            start, stop = r["shard"]
            assert torch.equal(r["anchor_at_start"], saved_by_ranks["anchor"][start:stop])
        for step in range(4):
            for island in islands:
                for rank in island[1:]:
                    assert torch.equal(ranks[rank]["params"][step], ranks[island[0]]["params"][step]), (step, rank)
        assert "inner optimizer states" not in output and "starts afresh" not in output
        # Saved while fp16 travelled across the islands (its mean saved whole), resumed: applied at step 6 with the
        # same mean and outer step, so with mixing 0 every rank holds the uninterrupted run's anchor there, bit for
        # bit, although that run computed and gathered it ahead on its worker and the resumed one at the apply.
        full, resumed_runs = _records(tmp_path, "overlap_full", world), _records(tmp_path, "overlap_half", world)
        for uninterrupted, resumed in zip(full, resumed_runs, strict=True):
            assert torch.equal(resumed["params"][1], uninterrupted["params"][5])


@pytest.mark.slow
def test_sync_every_auto_across_islands_of_2_nodes_x_2_ranks(tmp_path):
    # The islands measure their first overlapped sync (started at 16, applied at 18) and agree on one H across the
    # islands' groups: the same choice on every rank, and the islands identical at each later sync's application.
    _run_nodes(tmp_path, 2, 2, ["auto"], worker="tests.islands_worker", timeout=600)
    ranks = _records(tmp_path, "auto", 4)
    choices = [r["sync_every_choice"] for r in ranks]
    assert choices[0] is not None and all(choice == choices[0] for choice in choices)
    choice = choices[0]
    assert choice.since == 16 and choice.sync_every > 2 and choice.sync_s > 0 and choice.compute_s > 0
    for step in range(18, 25):
        applied = step == 18 or (step - 18) % choice.sync_every == 0
        assert torch.equal(ranks[0]["params"][step - 1], ranks[2]["params"][step - 1]) == applied, step
        assert torch.equal(ranks[0]["params"][step - 1], ranks[1]["params"][step - 1]), step  # one island
    assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)


@pytest.mark.quick
def test_replica_layouts_and_their_errors():
    nodes = Topology(rank=3, nodes=((0, 1), (2, 3)))
    auto = plan_islands("auto", nodes, 4, 3)
    assert auto.members == ((0, 1), (2, 3)) and auto.leader == 2 and auto.size == 2 and auto.count == 2
    assert plan_islands("node", nodes, 4, 3).members == ((0, 1), (2, 3))
    assert plan_islands("rank", nodes, 4, 3).members == ((0,), (1,), (2,), (3,))
    one_node = Topology(rank=0, nodes=((0, 1, 2, 3),))
    flat = plan_islands("auto", one_node, 4, 0)
    assert flat.size == 1 and "a replica per rank" in flat.reason and "one node" in flat.reason
    assert plan_islands(2, one_node, 4, 0).members == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match=r"replica='node' needs several nodes with as many ranks on each; this run"):
        plan_islands("node", one_node, 4, 0)
    with pytest.raises(ValueError, match=r"replica='node' needs .* 2 nodes with 2, 1 ranks"):
        plan_islands("node", Topology(rank=0, nodes=((0, 1), (2,))), 3, 0)
    with pytest.raises(ValueError, match=r"replica=3 with 4 ranks: the ranks per replica must divide the world"):
        plan_islands(3, one_node, 4, 0)
    with pytest.raises(ValueError, match=r"replica=4 with 4 ranks: .* leave at least two replicas"):
        plan_islands(4, one_node, 4, 0)
    with pytest.raises(ValueError, match=r"replica='island' is not valid; choose one of \['auto', 'rank', 'node'\]"):
        LocalSGDConfig(replica="island")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"replica=0 is not valid"):
        LocalSGDConfig(replica=0)
