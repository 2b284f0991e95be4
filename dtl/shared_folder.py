"""Does every node see this folder? Checked before a run writes there from one rank only.

Some things a job writes once and every node reads: day 28's data shards (global rank 0 writes
them, every rank reads its rows), day 24's checkpoints (rank 0 renames the finished step into
place, every rank loads its shard). Both assume a file system that every node mounts at the
same path. On one node that always holds; across nodes it holds only on a shared file system
(NFS, Lustre, a cluster's home), and without it the second node finds no shards, or loads a
checkpoint that is not there, minutes into the run.

    require_shared_folder(folder, "data folder")   # every rank calls it, after dtl.dist.init()

On one node it returns at once. Across nodes, each node's local rank 0 writes a marker file
into the folder, every node looks for every other node's marker, and a node that cannot see
one stops the job on every rank with one line naming the folder.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from dtl.dist import cleanup, exit_with_error, run_device


def node_and_nodes() -> tuple[int, int]:
    """(this node's index, the number of nodes), from torchrun's GROUP_RANK, WORLD_SIZE and
    LOCAL_WORLD_SIZE; (0, 1) outside torchrun."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_world < 1:
        return 0, 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("GROUP_RANK", "0")), max(1, world // local_world)


def _marker(folder: str, node: int, token: int) -> str:
    return os.path.join(folder, f".dtl-node{node}-{token:x}")


def _common_token() -> int:
    """One random number for this check, the same on every rank (rank 0's, broadcast). Not the
    job's id and restart count: a node that replaces a dead one starts at restart 0 while the
    survivors are at 1, and names derived from them would never match."""
    mine = int.from_bytes(os.urandom(7), "little")  # not torch's generator: training's stream
    token = torch.tensor([mine], dtype=torch.int64, device=run_device())
    dist.broadcast(token, src=0)  # (1,) int64: rank 0's number on every rank
    return int(token.item())


def shared_folder_problem(folder: str, what: str) -> str | None:
    """None when every node sees `folder` (or there is one node); else one line saying which
    node misses which. A collective: every rank of the default group calls it."""
    node, nodes = node_and_nodes()
    if nodes == 1 or not dist.is_initialized():
        return None
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    token = _common_token()
    if first_on_node:
        os.makedirs(folder, exist_ok=True)
        with open(_marker(folder, node, token), "w") as f:
            f.write(socket.gethostname())
    dist.barrier()  # every node's marker is written before any node looks
    # (nodes,): entry n = 1 + the first node whose marker node n cannot see; 0: sees them all
    unseen = torch.zeros(nodes, dtype=torch.int64, device=run_device())
    if first_on_node:
        missing = [n for n in range(nodes) if not os.path.exists(_marker(folder, n, token))]
        unseen[node] = missing[0] + 1 if missing else 0
    dist.all_reduce(unseen)  # only each node's first rank wrote its entry: the sum is the table
    dist.barrier()  # every node has looked: the markers can go
    if first_on_node and os.path.exists(_marker(folder, node, token)):
        os.remove(_marker(folder, node, token))
    blind = [(n, int(m) - 1) for n, m in enumerate(unseen.tolist()) if m]
    if not blind:
        return None
    n, m = blind[0]
    return (
        f"{what} {os.path.abspath(folder)} is not shared by every node: node {n} cannot see "
        f"what node {m} wrote there; put it on a file system every node mounts at that path"
    )


def require_shared_folder(folder: str, what: str) -> None:
    """shared_folder_problem, and a stop on every rank (one line from rank 0, exit 2) if any."""
    problem = shared_folder_problem(folder, what)
    if problem:
        cleanup()
        exit_with_error(problem)
