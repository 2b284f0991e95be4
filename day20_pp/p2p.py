"""Day 20: the point-to-point messages a schedule makes, played as NCCL runs them.

`p2p_posts` lists, per rank, the receives and sends the runtime (pipeline.py) posts for its
actions; a message between two stages on the same rank (the turn of a V placement) is a hand-off
in memory, not a post. `message_orders` pairs what a rank sends with what its peer waits for
(NCCL ignores tags: the orders must agree). `play_p2p` runs the posts under NCCL's rules (one
stream per rank pair and process group, in posting order, no buffering) and raises Deadlock
where a GPU run would hang.
"""

from __future__ import annotations

from collections import deque

from day20_pp.placement import Schedule, placement_of
from day20_pp.schedules import Deadlock


def p2p_posts(schedule: Schedule, v: int = 1) -> list[list[tuple[str, int, tuple]]]:
    """Per rank, its point-to-point operations in the order the runtime (pipeline.py) posts
    them: ("recv", source rank, message) before an action's compute, ("send", destination rank,
    message) after it. A message is (kind, receiving stage, micro-batch), kind "act" or "grad".
    Between two stages of one rank there is no post: the runtime hands the tensor over."""
    place = placement_of(schedule, v)
    out = []
    for r, acts in enumerate(schedule):
        posts = []
        for a in acts:
            for op, peer_stage, msg in _messages(a, place.stage(r, a.chunk), place.n_stages):
                if place.rank(peer_stage) != r:  # two stages of one rank: a hand-off, no post
                    posts.append((op, place.rank(peer_stage), msg))
        out.append(posts)
    return out


def _messages(a, stage: int, n_stages: int) -> list[tuple[str, int, tuple]]:
    """One action's messages in posting order: (op, the peer's stage, message)."""
    out = []
    if a.kind == "F":  # the activation from the previous stage, then to the next
        if stage > 0:
            out.append(("recv", stage - 1, ("act", stage, a.mb)))
        if stage < n_stages - 1:
            out.append(("send", stage + 1, ("act", stage + 1, a.mb)))
    elif a.kind in ("B", "I"):  # dL/d(output) from the next stage, dL/d(input) back
        if stage < n_stages - 1:
            out.append(("recv", stage + 1, ("grad", stage, a.mb)))
        if stage > 0:
            out.append(("send", stage - 1, ("grad", stage - 1, a.mb)))
    return out


def message_orders(schedule: Schedule, v: int = 1) -> dict[tuple[int, int, str], tuple[list, list]]:
    """For every (sender, receiver, lane): the messages in the order the sender posts them and
    in the order the receiver waits for them. NCCL ignores p2p tags and matches messages between
    two ranks of one process group by order alone, so the two lists must be equal (gloo matches
    by tag). The lane of each message is the runtime's (p2p_lane)."""
    out: dict[tuple[int, int, str], tuple[list, list]] = {}
    for r, posts in enumerate(p2p_posts(schedule, v)):
        for op, peer, msg in posts:
            src, dst, side = (r, peer, 0) if op == "send" else (peer, r, 1)
            out.setdefault((src, dst, p2p_lane(src, dst, msg[0])), ([], []))[side].append(msg)
    return out


# --- the same lists as NCCL runs them: one stream per rank pair and process group ----------------


LANES = ("up-act", "up-grad", "down-act", "down-grad")  # the runtime's process groups, per pipeline


def p2p_lane(src: int, dst: int, kind: str) -> str:
    """The process group ("lane") a message of `kind` ("act" or "grad") from pipeline rank `src`
    to `dst` travels on: its direction ("up" toward a higher rank, "down" toward a lower one)
    and its kind. NCCL runs every p2p operation between two ranks of one group on one stream, in
    posting order, so each lane must carry messages its two ends post in the same order
    (message_orders). By direction alone, a V breaks it: rank r sends chunk 0's activations up
    and chunk 1's gradients up too, and its neighbour waits for the two in another interleaving
    (DualPipe-V at p = 4 would hand a receive the wrong tensor). By kind alone, interleaved at
    pp = 2 sends activations both ways between the same two ranks and hangs. Direction and kind
    together carry one-way traffic of one kind, in one order on both ends, for every schedule."""
    return f"{'up' if src < dst else 'down'}-{kind}"


def play_p2p(schedule: Schedule, v: int = 1, lane=None, per_group: bool = False) -> None:
    """Post every rank's sends and receives as the runtime does and run them as NCCL does;
    raise Deadlock if they hang or would hand a receive the wrong message.

    The runtime posts a send and goes on (isend), and blocks on each receive. NCCL queues the
    operations of a (group, rank pair) on one stream per rank, in posting order, and moves a
    large message only while its send heads the sender's stream and its receive heads the
    receiver's: a send waits for its receive, and everything behind it waits too. `lane(src,
    dst, message)` names the group a message travels on; default: the runtime's p2p_lane.
    per_group=True: one stream per (rank, group) for every peer, the stricter order of a torch
    that runs p2p on the group's own communicator (eager init)."""
    lane = lane or (lambda src, dst, msg: p2p_lane(src, dst, msg[0]))
    posts = p2p_posts(schedule, v)
    pos, waiting = [0] * len(posts), [None] * len(posts)
    streams: dict[tuple, deque] = {}  # (rank, lane[, peer]) -> [op, peer, message, done]

    def stream(rank: int, ln: str, peer: int) -> tuple:
        return (rank, ln) if per_group else (rank, ln, peer)

    while True:
        moved = _post(posts, pos, waiting, streams, lane, stream)
        moved = _match_heads(streams, stream) or moved
        if all(pos[r] == len(ops) for r, ops in enumerate(posts)):
            if not any(streams.values()):
                return
        if not moved:
            blocked = {r: ops[pos[r]] for r, ops in enumerate(posts) if pos[r] < len(ops)}
            heads = {k: q[0][:3] for k, q in streams.items() if q}
            raise Deadlock(f"p2p: no rank can proceed; next posts {blocked}; stream heads {heads}")


def _post(posts, pos, waiting, streams, lane, stream) -> bool:
    """Each rank posts until it blocks in a receive that has not completed."""
    moved = False
    for r, ops in enumerate(posts):
        while pos[r] < len(ops):
            if waiting[r] is not None:  # inside a receive: wait for it
                if not waiting[r][3]:
                    break
                waiting[r], pos[r], moved = None, pos[r] + 1, True
                continue
            op, peer, msg = ops[pos[r]]
            src, dst = (r, peer) if op == "send" else (peer, r)
            ln = lane(src, dst, msg)
            entry = [op, peer, msg, False]
            streams.setdefault(stream(r, ln, peer), deque()).append(entry)
            moved = True
            if op == "recv":
                waiting[r] = entry
            else:
                pos[r] += 1
    return moved


def _match_heads(streams, stream) -> bool:
    """A send at the head of its stream meets the receive at the head of its peer's."""
    moved = False
    for key, queue in streams.items():
        if not queue or queue[0][0] != "send":
            continue
        (r, ln), (_, peer, msg, _) = key[:2], queue[0]
        other = streams.get(stream(peer, ln, r))
        if not other or other[0][0] != "recv" or other[0][1] != r:
            continue
        if other[0][2] != msg:
            raise Deadlock(
                f"p2p: rank {r} sends {msg} to rank {peer} on lane {ln}, whose receive there "
                f"waits for {other[0][2]}: NCCL would hand it the wrong tensor"
            )
        queue.popleft()
        other.popleft()[3] = True
        moved = True
    return moved
