"""All-reduce by hand, from point-to-point send/recv only: ring, binary tree, double binary tree.

Each function works in place on a tensor, like `dist.all_reduce(x)` (SUM), and returns a `Stats`
record: the number of rounds it ran (`steps`) and the bytes this rank sent and received. The tests
compare the result with `dist.all_reduce` and the counts with the closed forms in `cost_model.py`.

Ring (Patarasuk & Yuan 2009; nccl-tests doc/PERFORMANCE.md): reduce-scatter then all-gather over n
chunks, 2(n-1) rounds, each rank sends 2(n-1)/n * S bytes. Tree: reduce to the root and broadcast
back, pipelined over chunks, ~2 log2(n) + k rounds. Double binary tree (Sanders, Speck & Traeff
2009, "Two-tree algorithms for full bandwidth broadcast, reduction and scan"; NVIDIA's NCCL 2.4
blog post): two trees, each carrying half of the data, built so that every rank is an inner node
in at most one of them.

A round = every rank posts its receives and sends for that round, then waits for them (irecv/isend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtl.exercise_seam import exercise

TREE_CHUNK_BYTES = 512 * 1024  # pipeline chunk; NCCL's tree uses 512 KiB slots (NVIDIA/nccl#391)


@dataclass
class Stats:
    steps: int = 0  # rounds of the schedule (the same on every rank, idle rounds included)
    bytes_sent: int = 0  # by this rank
    bytes_recv: int = 0


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _exchange(sends, recvs, group, stats: Stats) -> None:
    """One round: every receive and send of this rank, posted together, then waited for.

    batch_isend_irecv, not a loop of isend/irecv: on NCCL two ranks that both post "recv, then
    send" to each other deadlock unless the calls are grouped (ncclGroupStart/End). Empty tensors
    are skipped on both sides (both know the chunk sizes): a tensor smaller than the world works."""
    ops = []
    for peer, buf, tag in recvs:
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, _global(group, peer), group, tag))
            stats.bytes_recv += buf.numel() * buf.element_size()
    for peer, buf, tag in sends:
        if buf.numel():
            ops.append(dist.P2POp(dist.isend, buf, _global(group, peer), group, tag))
            stats.bytes_sent += buf.numel() * buf.element_size()
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    stats.steps += 1


_WORKSPACE: dict = {}


def _workspace(slot: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A scratch buffer kept between calls (NCCL keeps its buffers too, NCCL_BUFFSIZE): a fresh
    64 MiB tensor per call would cost page faults, not communication, and blur the benchmark."""
    key = (slot, like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _flat(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("hand-written collectives need a contiguous tensor")
    return x.view(-1)


# ---------------------------------------------------------------------------------------------
# Ring: n chunks (torch.tensor_split sizes: the first N mod n chunks hold one element more)
# ---------------------------------------------------------------------------------------------


@exercise("day16.ring_reduce_scatter")
def _ring_reduce_scatter_(src, dst, group, stats: Stats) -> None:
    # src and dst are lists of n chunk views; they may be the same list (in place).
    # After n-1 rounds dst chunk r holds the sum over all ranks (the dist.reduce_scatter layout).
    # Each round every rank sends one chunk to its right neighbour and receives one from its left
    # (one _exchange: all ranks move at once), adds the received partial sum to its own copy of
    # that chunk in dst, and sends that chunk on in the next round; round 0 sends src's data.
    # A chunk's partial sum travels n-1 hops and gathers one rank's term per hop: choose the
    # chunk indices so that the chunk rank r receives last is chunk r.
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    recv = _workspace("recv", src[0].numel(), src[0])  # chunk 0 is a largest chunk
    for s in range(n - 1):
        # exercise day16.ring_reduce_scatter: begin
        # round s: send chunk (r-s-1) right, receive chunk (r-s-2) from the left, add it
        send = (src if s == 0 else dst)[(r - s - 1) % n]  # round 0 sends my own data
        i = (r - s - 2) % n
        buf = recv[: src[i].numel()]  # the received chunk lands aside, then is added
        _exchange([(right, send, 0)], [(left, buf, 0)], group, stats)
        torch.add(src[i], buf, out=dst[i])
        # exercise day16.ring_reduce_scatter: end


@exercise("day16.ring_all_gather")
def _ring_all_gather_(chunks, group, stats: Stats) -> None:
    # Before: chunk r of `chunks` (n views) is complete on rank r, what the reduce-scatter left.
    # After n-1 rounds every chunk is complete on every rank. Each round every rank sends one
    # chunk to its right neighbour and receives one from its left (one _exchange), straight
    # into place: nothing is added, a complete chunk is copied on around the ring.
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    # exercise day16.ring_all_gather: begin
    for s in range(n - 1):  # round s: send chunk (r-s) right, receive chunk (r-s-1) from the left
        _exchange(
            [(right, chunks[(r - s) % n], 0)], [(left, chunks[(r - s - 1) % n], 0)], group, stats
        )
    # exercise day16.ring_all_gather: end


def ring_all_reduce(x: torch.Tensor, group=None) -> Stats:
    """In place: x <- sum over ranks. 2(n-1) rounds; rank r sends 2N - |c_r| - |c_(r+1)|
    elements (c_i = chunk i): 2(n-1)/n * N when n divides N."""
    stats = Stats()
    chunks = _flat(x).tensor_split(dist.get_world_size(group))  # n views into x
    _ring_reduce_scatter_(chunks, chunks, group, stats)
    _ring_all_gather_(chunks, group, stats)
    return stats


def ring_reduce_scatter(x: torch.Tensor, group=None, out=None) -> tuple[torch.Tensor, Stats]:
    """Return (chunk r of the sum, stats); x (N,) is left untouched. n-1 rounds."""
    stats = Stats()
    n, r, flat = dist.get_world_size(group), dist.get_rank(group), _flat(x)
    dst = _workspace("partial", flat.numel(), flat).tensor_split(n)  # the partial sums
    if n > 1:
        _ring_reduce_scatter_(flat.tensor_split(n), dst, group, stats)
    out = torch.empty_like(dst[r]) if out is None else out
    return out.copy_(dst[r] if n > 1 else flat), stats


def ring_all_gather(
    mine: torch.Tensor, numel: int, group=None, out=None
) -> tuple[torch.Tensor, Stats]:
    """Every rank holds chunk r of a length-`numel` vector (tensor_split sizes); return the whole
    vector on every rank. n-1 rounds."""
    stats = Stats()
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if out is None:
        out = torch.empty(numel, dtype=mine.dtype, device=mine.device)
    chunks = out.tensor_split(n)
    if chunks[r].numel() != mine.numel():
        raise ValueError(
            f"rank {r}: chunk has {mine.numel()} elements, expected "
            f"{chunks[r].numel()} (torch.tensor_split({numel}, {n}))"
        )
    chunks[r].copy_(mine.view(-1))
    _ring_all_gather_(chunks, group, stats)
    return out, stats


# ---------------------------------------------------------------------------------------------
# Trees. Label every rank l = r + 1. In the in-order binary tree over labels 1..n, a label whose
# lowest set bit is b sits at height log2(b); its parent is l + b or l - b (whichever has bit 2b
# set), or l - b when l + b is past n. Odd labels (even ranks) are the leaves.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    parent: tuple[int, ...]  # parent[r], -1 at the root
    children: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]  # root = 0

    @property
    def height(self) -> int:
        return max(self.depth)

    def inner(self) -> set[int]:
        return {r for r, kids in enumerate(self.children) if kids}


def _from_parents(parent: list[int]) -> Tree:
    n = len(parent)
    children = [sorted(c for c in range(n) if parent[c] == r) for r in range(n)]
    depth = []
    for r in range(n):
        d, p = 0, parent[r]
        while p != -1:
            d, p = d + 1, parent[p]
            if d > n:
                raise ValueError(f"rank {r}: its parent links form a cycle, not a tree")
        depth.append(d)
    return Tree(tuple(parent), tuple(tuple(c) for c in children), tuple(depth))


def binary_tree(n: int) -> Tree:
    """The in-order binary tree over ranks 0..n-1 (inner nodes = odd ranks). Root: rank P-1, P the
    largest power of two <= n. NCCL's src/graph/trees.cc uses the same bit pattern on the ranks
    themselves (root rank 0, leaves the odd ranks): ours is that tree shifted by one label."""
    parent = []
    for label in range(1, n + 1):
        b = label & -label
        up = label - b if label & (2 * b) else label + b
        if up > n:
            up = label - b  # would-be parent past the end: attach to the node below instead
        parent.append(up - 1)  # label 0 means "no parent": -1
    return _from_parents(parent)


@exercise("day16.double_tree")
def double_binary_tree(n: int) -> tuple[Tree, Tree]:
    """Tree 1 = binary_tree(n) (inner nodes: odd ranks; leaves: even ranks). Tree 2 = tree 1 with
    its ranks relabelled by a bijection that sends every odd rank to an even one: the inner nodes
    of tree 2 are then even ranks, and no rank is inner in both trees. Relabelling keeps the
    shape (binary, same height); the map has to work for even and for odd n."""
    t1 = binary_tree(n)
    # parent[m(r)] = m(t1.parent[r]): tree 2's parent of rank m(r), -1 for the root
    # exercise day16.double_tree: begin
    # mirror r -> n-1-r when n is even; when n is odd the mirror keeps parity (n-1 is even): shift
    move = (lambda r: n - 1 - r) if n % 2 == 0 else (lambda r: (r + 1) % n)
    parent = [0] * n
    for r in range(n):
        parent[move(r)] = -1 if t1.parent[r] == -1 else move(t1.parent[r])
    # exercise day16.double_tree: end
    return t1, _from_parents(parent)


def tree_round_ops(tree: Tree, r: int, t: int, k: int):
    """What rank r does in round t of a pipelined reduce+broadcast of k chunks over `tree`.

    Up (reduce): a node at depth d sends chunk t-(D-d) to its parent, after its children sent it
    that chunk one round earlier. Down (broadcast): the root sends chunk c at round c+D, a node at
    depth d forwards it at round c+D+d. Up and down overlap, as NCCL's tree does.
    Rounds: k + 2D - 1.
    Returns (sends, recvs) as lists of (peer, chunk index, "up" | "down")."""
    D, d = tree.height, tree.depth[r]
    sends, recvs = [], []
    c_up, c_kids, c_down, c_parent = t - (D - d), t - (D - d - 1), t - D - d, t - D - d + 1
    if tree.parent[r] != -1:
        if 0 <= c_up < k:
            sends.append((tree.parent[r], c_up, "up"))
        if 0 <= c_parent < k:
            recvs.append((tree.parent[r], c_parent, "down"))
    for child in tree.children[r]:
        if 0 <= c_kids < k:
            recvs.append((child, c_kids, "up"))
        if 0 <= c_down < k:
            sends.append((child, c_down, "down"))
    return sends, recvs


def tree_rounds(tree: Tree, k: int) -> int:
    return k + 2 * tree.height - 1 if k and tree.height else 0


def _trees_all_reduce_(segments, trees, chunk_numel: int, group, stats: Stats) -> None:
    """Run one pipelined tree per (segment, tree) pair, all in the same rounds (tag = tree id)."""
    r = dist.get_rank(group)
    chunked = [seg.split(chunk_numel) if seg.numel() else () for seg in segments]
    n_rounds = max(tree_rounds(tree, len(ch)) for tree, ch in zip(trees, chunked))
    # at most 2 children per tree, 2 trees: 4 chunks arrive "aside" per round
    spare = _workspace("recv", 4 * chunk_numel, segments[0]).split(chunk_numel)
    for t in range(n_rounds):
        sends, recvs, adds = [], [], []
        for tag, (tree, chunks) in enumerate(zip(trees, chunked), start=1):
            s_ops, r_ops = tree_round_ops(tree, r, t, len(chunks))
            sends += [(peer, chunks[c], tag) for peer, c, _ in s_ops]
            for peer, c, way in r_ops:
                if way == "up":  # a partial sum from a child: receive aside, add after the wait
                    buf = spare[len(adds)][: chunks[c].numel()]
                    recvs.append((peer, buf, tag))
                    adds.append((chunks[c], buf))
                else:  # the final sum from the parent: receive straight into place
                    recvs.append((peer, chunks[c], tag))
        _exchange(sends, recvs, group, stats)
        for dst, buf in adds:  # children in ascending rank order: a fixed summation order
            dst.add_(buf)


def tree_all_reduce(x: torch.Tensor, group=None, chunk_bytes: int = TREE_CHUNK_BYTES) -> Stats:
    """In place: x <- sum over ranks, by one pipelined binary tree (k = ceil(S / chunk) chunks)."""
    stats = Stats()
    n = dist.get_world_size(group)
    flat = _flat(x)
    _trees_all_reduce_([flat], [binary_tree(n)], _chunk_numel(x, chunk_bytes), group, stats)
    return stats


def double_tree_all_reduce(
    x: torch.Tensor, group=None, chunk_bytes: int = TREE_CHUNK_BYTES
) -> Stats:
    """In place: x <- sum over ranks. First ceil(N/2) elements go through tree 1, the rest through
    tree 2, concurrently."""
    stats = Stats()
    n, flat = dist.get_world_size(group), _flat(x)
    half = (flat.numel() + 1) // 2
    _trees_all_reduce_(
        [flat[:half], flat[half:]],
        list(double_binary_tree(n)),
        _chunk_numel(x, chunk_bytes),
        group,
        stats,
    )
    return stats


def _chunk_numel(x: torch.Tensor, chunk_bytes: int) -> int:
    if chunk_bytes < x.element_size():
        raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element")
    return chunk_bytes // x.element_size()


ALL_REDUCES = {"ring": ring_all_reduce, "tree": tree_all_reduce, "dbt": double_tree_all_reduce}
