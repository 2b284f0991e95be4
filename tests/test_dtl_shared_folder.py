"""dtl.shared_folder: a folder that one node writes and every node reads is checked at start.

Two "nodes" of two ranks each on one machine (torchrun's GROUP_RANK, LOCAL_RANK and
LOCAL_WORLD_SIZE set per rank, as two agents would): given the same path they share it; given a
path of their own each (what two hosts without a shared file system see) the check names the
folder and the node that cannot see the other's marker, on every rank.
"""

import os

from dtl.shared_folder import node_and_nodes, shared_folder_problem
from dtl.testing import run_distributed


def _as_two_nodes(base: str, shared: bool) -> str | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    node = rank // 2
    os.environ.update(
        GROUP_RANK=str(node), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", WORLD_SIZE="4"
    )
    folder = base if shared else os.path.join(base, f"host{node}", "data")
    return shared_folder_problem(folder, "data folder")


def test_a_folder_every_node_sees_passes_and_the_markers_are_removed(tmp_path):
    assert run_distributed(_as_two_nodes, str(tmp_path), True, world_size=4) == [None] * 4
    assert os.listdir(tmp_path) == []


def test_a_folder_one_node_cannot_see_stops_every_rank_with_one_line_naming_it(tmp_path):
    problems = run_distributed(_as_two_nodes, str(tmp_path), False, world_size=4)
    # every rank decides alike, none goes on to write alone (each names the path it was given:
    # on real hosts one path, here a folder per "host")
    assert all(p and p.endswith(problems[0].split(" is ")[1]) for p in problems)
    folder = os.path.join(tmp_path, "host0", "data")
    assert problems[0] == (
        f"data folder {folder} is not shared by every node: node 0 cannot see what node 1 "
        "wrote there; put it on a file system every node mounts at that path"
    )


def test_one_node_needs_no_check(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_and_nodes() == (0, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert node_and_nodes() == (0, 1)
    assert shared_folder_problem("/nonexistent/never/written", "data folder") is None
