"""CPU-core binding plans."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_ddpopt.affinity import CoreBinding, available_cores, cpu_layout, plan_core_sets, plan_given_cores

pytestmark = pytest.mark.quick


def _two_socket_smt(root):
    """A fake sysfs: 2 NUMA nodes of 4 physical cores, 2 threads each, numbered physical cores first (cpu i and i + 8
    are siblings), as Linux numbers them."""
    for cpu in range(16):
        topology = root / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        package = (cpu % 8) // 4
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{cpu % 4}\n")
    for node, cpulist in enumerate(("0-3,8-11", "4-7,12-15")):
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    return str(root)


def test_ranks_get_whole_physical_cores_in_numa_order(tmp_path):
    layout = cpu_layout(range(16), root=_two_socket_smt(tmp_path))
    assert layout is not None and layout[0] == layout[8] == (0, 0, 0) and layout[13] == (1, 1, 1)
    # In id order, ranks 2 and 3 would get the siblings of ranks 0 and 1's cores, on the other NUMA node.
    assert plan_core_sets(range(16), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert plan_core_sets(list(range(16)), 4, layout) == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert plan_core_sets(list(range(16)), 8, layout)[1] == [1, 9]
    # More ranks than physical cores: the logical ids in order, every rank still has its own.
    assert plan_core_sets(list(range(16)), 16, layout) == [[cpu] for cpu in range(16)]
    assert plan_given_cores([list(range(16))] * 2, layout)[0] == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]


def test_without_a_cpu_topology_the_layout_is_unknown(tmp_path):
    assert cpu_layout([0, 1], root=str(tmp_path)) is None


def test_plan_splits_cores_evenly_and_disjointly():
    assert plan_core_sets(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_core_sets(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan_core_sets([4, 9], 2) == [[4], [9]]


def test_plan_refuses_fewer_cores_than_ranks():
    with pytest.raises(ValueError, match=r"3 local ranks but only 2 usable cores \[0, 1\]"):
        plan_core_sets([0, 1], 3)


def test_binding_pins_and_restores():
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = available_cores()[-1]
    binding = CoreBinding([core])
    try:
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
    finally:
        binding.release()
    assert os.sched_getaffinity(0) == before_cores
    assert torch.get_num_threads() == before_threads


def test_ranks_given_the_same_cores_split_them_and_ranks_given_their_own_keep_them():
    # Started by Lightning (or torchrun, which does not bind): every local rank was given all of them.
    assert plan_given_cores([[0, 1, 2, 3]] * 2) == (
        [[0, 1], [2, 3]],
        "the local ranks were given the same cores [0, 1, 2, 3]: split",
    )
    assert plan_given_cores([[5, 6]]) == ([[5, 6]], "one local rank, given cores [5, 6]: kept")
    # Bound by the launcher (srun --cpu-bind=cores): never a core a rank was not given.
    assert plan_given_cores([[3, 2], [0, 1]]) == (
        [[2, 3], [0, 1]],
        "the launcher gave each local rank cores of its own: kept",
    )
    sets, how = plan_given_cores([[0, 1, 2], [2, 3]])
    assert sets == [[0, 1, 2], [2, 3]] and "some cores given to more than one" in how
    # srun --cpu-bind=sockets: two ranks per socket, each pair given its socket's cores.
    assert plan_given_cores([[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]) == (
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ranks given the same cores split them",
    )
    assert plan_given_cores([[0, 1], [0, 1], [2]])[1] == "ranks given the same cores split them, the others keep theirs"
    with pytest.raises(ValueError, match="2 local ranks but only 1 usable cores"):
        plan_given_cores([[7], [7]])


def test_binding_pins_threads_that_already_run():
    import threading

    core = available_cores()[-1]
    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait()
        seen.append(os.sched_getaffinity(0))
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()  # before the binding, as a process group's threads are
    binding = CoreBinding([core])
    try:
        go.set()
        done.wait(10)
        assert seen == [{core}]
    finally:
        binding.release()
        thread.join()
    assert os.sched_getaffinity(0) == before


def test_ranks_split_the_cores_of_their_gpus_numa_nodes(tmp_path):
    layout = cpu_layout(range(16), root=_two_socket_smt(tmp_path))
    # 4 local ranks whose GPUs hang off NUMA nodes 1, 0, 1, 0: each pair splits its node's physical cores.
    plan, how = plan_given_cores([list(range(16))] * 4, layout, gpu_nodes=[1, 0, 1, 0])
    assert plan == [[4, 5, 12, 13], [0, 1, 8, 9], [6, 7, 14, 15], [2, 3, 10, 11]]
    assert how.endswith(
        ", each rank on its GPU's NUMA node (rank 0: node 1, rank 1: node 0, rank 2: node 1, rank 3: node 0)"
    )
    # All on one node: that node's 4 physical cores, one each for 4 ranks; the other node's cores stay free.
    assert plan_given_cores([list(range(16))] * 4, layout, gpu_nodes=[0] * 4)[0] == [[0, 8], [1, 9], [2, 10], [3, 11]]
    # More ranks on a node than it has physical cores, or a GPU whose node is unknown: the plain split, no claim.
    for nodes in ([0] * 5 + [1], [0, None]):
        ranks = len(nodes)
        plan, how = plan_given_cores([list(range(16))] * ranks, layout, gpu_nodes=nodes)
        assert plan == plan_given_cores([list(range(16))] * ranks, layout)[0] and "GPU" not in how


def test_a_gpus_numa_node_comes_from_its_pci_device(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lightning_ddpopt.affinity import gpu_numa_node

    assert gpu_numa_node(torch.device("cpu")) is None and gpu_numa_node(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    properties = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    device = tmp_path / "0000:3b:00.0"
    device.mkdir()
    (device / "numa_node").write_text("1\n")
    assert gpu_numa_node(torch.device("cuda", 0), root=str(tmp_path)) == 1
    (device / "numa_node").write_text("-1\n")  # the platform does not say
    assert gpu_numa_node(torch.device("cuda", 0), root=str(tmp_path)) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace())  # an older torch
    assert gpu_numa_node(torch.device("cuda", 0), root=str(tmp_path)) is None
