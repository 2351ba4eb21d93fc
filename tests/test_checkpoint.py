"""Gathering every rank's hook state to rank 0 at a save: on the CPU, one rank's state at a time."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from lightning_ddpopt._groups import destroy_all_groups
from lightning_ddpopt.checkpoint import SavedRun
from lightning_ddpopt.checkpoint_meeting import RankStates
from lightning_ddpopt.hooks.auto import HookChoice


def _state(rank: int) -> dict[str, object]:
    # Rank r's error feedback: (r + 1) x 20000 values, so the ranks' states differ in size.
    return {"iteration": 7, "errors": {"w": torch.full(((rank + 1) * 20000,), float(rank))}}


def _gather_worker(rank: int, port: int, world_size: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    received: list[tuple[int, str]] = []
    original = distributed_c10d._tensor_to_object

    def probe(tensor, *args, **kwargs):  # every pickled state this rank receives, as the bytes it arrived in
        received.append((tensor.numel() * tensor.element_size(), tensor.device.type))
        return original(tensor, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("a gather of every rank's pickled state at once")

    distributed_c10d._tensor_to_object = probe
    distributed_c10d.gather_object = distributed_c10d.all_gather_object = forbidden
    states = RankStates(timeout_s=30)
    states.name_run("test")
    gathered = states.gather(_state(rank), rank=rank, world_size=world_size)
    states.close()
    if rank == 0:
        torch.save({"gathered": gathered, "received": received}, out)
    destroy_all_groups()


@pytest.mark.slow
def test_states_travel_to_rank_0_on_the_cpu_one_rank_at_a_time(tmp_path):
    # Rank 0 receives each other rank's pickled state in turn: the largest buffer it holds at once is one rank's
    # state, not world_size x the largest (what gathering every rank's state in one collective allocates).
    out = str(tmp_path / "gathered.pt")
    # spawn: forked from a test process that ran other process groups before, a rank can hang before it arrives.
    mp.start_processes(_gather_worker, args=(29571, 3, out), nprocs=3, start_method="spawn")
    result = torch.load(out)
    gathered = result["gathered"]
    assert [state["iteration"] for state in gathered] == [7, 7, 7]
    for rank, state in enumerate(gathered):
        torch.testing.assert_close(state["errors"]["w"], _state(rank)["errors"]["w"], rtol=0, atol=0)
    pickled = [len(pickle.dumps(_state(rank))) for rank in range(3)]
    # One buffer per other rank, on the CPU, each about that rank's pickled state (torch's pickler, not pickle's).
    assert [device for _, device in result["received"]] == ["cpu", "cpu"]
    for (size, _), expected in zip(result["received"], pickled[1:], strict=True):
        assert 0.9 * expected < size < 1.1 * expected


@pytest.mark.quick
def test_the_entry_holds_the_states_tensors_themselves_and_reads_back_plainly(tmp_path):
    # Rank 0 holds every rank's state while it writes the file: a deep copy would double that.
    errors = [{"weight": torch.randn(4, 3)} for _ in range(2)]
    saved = SavedRun(
        world_size=2,
        comm_hook="int8",
        hook_states=[{"iteration": 5, "errors": rank_errors} for rank_errors in errors],
        hook_choice=HookChoice("int8", {"allreduce": 0.2, "int8": 0.1}, "fastest"),
        bucket_latency_s=64e-6,
    )
    entry = saved.to_checkpoint()
    assert all(entry["hook_states"][r]["errors"]["weight"] is errors[r]["weight"] for r in range(2))
    assert entry["hook_choice"] == {"name": "int8", "estimates_s": {"allreduce": 0.2, "int8": 0.1}, "reason": "fastest"}
    torch.save({"ddpopt": entry}, tmp_path / "entry.pt")
    loaded = torch.load(tmp_path / "entry.pt", weights_only=True)["ddpopt"]  # plain types only
    restored = SavedRun.from_checkpoint(loaded)
    assert restored.hook_choice == saved.hook_choice
    assert restored.bucket_latency_s == 64e-6
    # An earlier release's entry with autotune's cap (retired) reads back without it.
    earlier = SavedRun.from_checkpoint({**loaded, "bucket_cap_mb": 1.5})
    assert (earlier.hook_choice, earlier.bucket_latency_s) == (restored.hook_choice, 64e-6)
    for r in range(2):
        assert torch.equal(restored.hook_states[r]["errors"]["weight"], errors[r]["weight"])


@pytest.mark.quick
def test_a_save_after_a_failed_meeting_fails_at_once_until_teardown_makes_a_new_group():
    from lightning_ddpopt.checkpoint_meeting import RankStates

    meeting = RankStates(timeout_s=1.0)
    meeting._failed = "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"  # what a timed-out meeting left
    with pytest.raises(RuntimeError, match=r"which an earlier save on fewer ranks closed \(\[Rank 0\]: Rank 1 failed"):
        meeting.agree(rank=0, world_size=2)  # at once: no collective, no wait
    meeting.close()  # teardown: a later save makes a new group on every rank alike
    assert meeting._failed is None and meeting.group is None
