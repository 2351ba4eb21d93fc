"""Per-rank checkpoint state as shards beside the file: each rank writes its own, reads its own, re-sliced on load."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.checkpoint import CHECKPOINT_KEY, SavedRun, read_saved_run
from lightning_ddpopt.checkpoint_shards import (
    SHARDS_SUFFIX,
    ShardReader,
    SlicedValues,
    clear_partial,
    find_shards,
    remove_shards,
    shard_directory,
    shards_supported,
    write_shards,
)
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import WarningsProbe, fit_ddp


@pytest.mark.quick
def test_a_state_and_slices_come_back_as_they_were_written(gloo_group, tmp_path):
    # An optimizer-like state: int keys, tuples, None, a 0-dim tensor, half-precision values.
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).view(2, 3)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": [0]}],
        "errors": {"net.0.weight": torch.ones(4, dtype=torch.float16)},
    }
    whole = torch.arange(10.0)
    path = tmp_path / "a.ckpt"
    clear_partial(path)
    tensors = {"outer/0/anchor": whole[:4], "outer/4/anchor": whole[4:8], "outer/8/anchor": whole[8:]}
    write_shards(path, {"hook/0": state, "hook/10": {"iteration": 10}}, tensors, rank=0, group=None, save_id="run/1")
    reader, problem = find_shards(path, path.name + SHARDS_SUFFIX, "run/1")
    assert reader is not None and not problem and reader.save_id() == "run/1"
    back = reader.state("hook/0")
    assert back["param_groups"] == state["param_groups"] and list(back["state"]) == [0]
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["state"][0]["step"].dim() == 0 and back["errors"]["net.0.weight"].dtype == torch.float16
    assert reader.state("hook/1") is None and reader.state("hook/10") == {"iteration": 10}  # not a prefix
    # Read by another layout's slices: each piece from the stored slices it overlaps.
    values = SlicedValues(reader, "anchor", [[0, 4], [4, 8], [8, 10]])
    assert values.numel() == 10
    for start, stop in [(0, 10), (3, 9), (4, 8), (9, 10), (0, 5)]:
        assert torch.equal(values[start:stop], whole[start:stop])
    # Saved again at the same path: the new shards replace the old ones, nothing is left beside them; a file that
    # names the first save is not read with the second's.
    write_shards(path, {"hook/0": {"iteration": 2}}, {}, rank=0, group=None, save_id="run/2")
    assert ShardReader(shard_directory(path)).state("hook/0") == {"iteration": 2}
    reader, problem = find_shards(path, path.name + SHARDS_SUFFIX, "run/1")
    assert reader is None and problem.endswith("holds another save's (the file and its shards were not saved together)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt" + SHARDS_SUFFIX, "store"]

    # Through a link (save_last="link"), beside which an old save's shards were left: the target's are read.
    path.write_bytes(b"")
    link = tmp_path / "last.ckpt"
    link.symlink_to(path.name)
    write_shards(link, {"hook/0": {"iteration": 1}}, {}, rank=0, group=None, save_id="run/0")
    reader, _ = find_shards(link, path.name + SHARDS_SUFFIX, "run/2")
    assert reader is not None and reader.directory == shard_directory(path)
    remove_shards(link)  # a link's removal leaves its target's shards
    assert os.path.isdir(shard_directory(path))
    remove_shards(path)
    assert not os.path.exists(shard_directory(path))


@pytest.mark.quick
def test_a_url_keeps_the_per_rank_state_in_the_file():
    assert shards_supported("checkpoints/epoch=0.ckpt") and shards_supported(Path("/data/a.ckpt"))
    assert not shards_supported("s3://bucket/epoch=0.ckpt")


@pytest.mark.quick
def test_shards_that_are_not_there_are_said_and_the_rest_loads(tmp_path):
    entry = SavedRun(world_size=2, comm_hook="powersgd").to_checkpoint()
    entry["shards"] = {
        "directory": "a.ckpt.ddpopt",
        "save_id": "run/1",
        "hook": True,
        "inner_owners": None,
        "outer_slices": [[0, 4], [4, 8]],
    }
    entry["local_sgd"] = {"steps": 12, "syncs": 3, "anchor": None, "momentum": None, "sharded": ["anchor"]}
    entry["local_sgd"]["in_flight"] = {"mean": None, "apply_at": 14, "wire_bytes": 8}
    said = r"rank 0: the checkpoint's per-rank state .* is not to be read: the directory .*a\.ckpt\.ddpopt is not there"
    with pytest.warns(UserWarning, match=said + r": copy or move it with the file\. .*keeps its counters"):
        saved = SavedRun.from_checkpoint(entry, tmp_path / "a.ckpt")
    assert not saved.has_hook_states and saved.comm_hook == "powersgd" and saved.inner_states(1) is None
    assert saved.local_sgd is not None and saved.local_sgd["steps"] == 12  # the counters stay, the travelling goes
    assert saved.local_sgd["anchor"] is None and saved.local_sgd["in_flight"] is None


def _strategy() -> OptimizedDDPStrategy:
    return OptimizedDDPStrategy(comm_hook=PowerSGDConfig(rank=2, start_iter=2), start_method="fork")


def test_each_rank_writes_its_own_shard_and_old_ones_go_with_their_files(tmp_path):
    # 3 ranks, a checkpoint every 2 steps, the newest 2 kept: ModelCheckpoint's removal takes the shards too; the
    # last one linked, the link's own removals leaving its targets' shards.
    saves = tmp_path / "ckpt"
    keep = ModelCheckpoint(
        dirpath=saves, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last="link"
    )
    ranks = fit_ddp(
        tmp_path / "fit", _strategy(), devices=3, samples=144, callbacks=[keep], max_steps=6, enable_checkpointing=True
    )
    files = sorted(p.name for p in saves.iterdir())
    assert files == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=4.ckpt" + SHARDS_SUFFIX,
        "epoch=0-step=6.ckpt",
        "epoch=0-step=6.ckpt" + SHARDS_SUFFIX,
        "last.ckpt",
    ]
    assert os.path.islink(saves / "last.ckpt")
    path = saves / "epoch=0-step=6.ckpt"
    # The file holds no rank's hook state; each rank wrote one file of its own (DCP's __<rank>_0.distcp).
    entry = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    assert entry["hook_states"] == [] and entry["shards"]["hook"]
    written = sorted(p.name for p in Path(shard_directory(path)).iterdir() if p.suffix == ".distcp")
    assert written == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    saved = read_saved_run(path)
    assert saved is not None
    states = [saved.hook_state(rank) for rank in range(3)]
    assert [state["iteration"] for state in states] == [6, 6, 6]
    key = next(iter(states[0]["errors"]))
    assert not torch.equal(states[0]["errors"][key], states[1]["errors"][key])  # each rank's own error feedback
    assert len({float(r["params"].sum()) for r in ranks}) == 1

    # Resumed through the link: no warning, the hook's state goes on from iteration 6. With the shards moved away:
    # said, and the hook starts afresh.
    def resume(out: Path, checkpoint: Path) -> tuple[list[int], list[str]]:
        probe = WarningsProbe(str(out / "warnings.pt"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ranks = fit_ddp(
                out,
                _strategy(),
                devices=3,
                samples=144,
                ckpt_path=str(checkpoint),
                max_steps=8,
                max_epochs=2,
                callbacks=[probe],
            )
        said = [w for w in torch.load(out / "warnings.pt") if w.startswith("ddpopt:")]
        return [r["hook_iteration"] for r in ranks], said

    assert resume(tmp_path / "resumed", saves / "last.ckpt") == ([8, 8, 8], [])
    os.rename(shard_directory(path), tmp_path / "elsewhere")
    iterations, said = resume(tmp_path / "without", path)
    assert iterations == [2, 2, 2] and len(said) == 1
    assert "rank 0: the checkpoint's per-rank state" in said[0]
    assert "epoch=0-step=6.ckpt.ddpopt is not there: copy or move it with the file" in said[0]
