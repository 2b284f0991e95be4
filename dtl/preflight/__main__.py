"""python -m dtl.preflight: run on every node before the launch line; exit 0 when all is well.

    python -m dtl.preflight --nnodes=2 --endpoint=node0:29500 [--node_rank=1] [--folders=a,b]

Without flags it reads the static launch variables a job script or Slurm sets: MASTER_ADDR,
MASTER_PORT, NNODES, NODE_RANK. Each problem is one line starting "preflight: problem:";
then exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from dtl.preflight import checks, exchange, network

DEFAULT_TIMEOUT_S = 60.0


def parse(argv: list[str] | None) -> tuple[checks.Launch, float]:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m dtl.preflight", description=__doc__)
    default_endpoint = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '29500')}"
    parser.add_argument("--endpoint", default=default_endpoint, help="host:port where nodes meet")
    parser.add_argument("--nnodes", default=env.get("NNODES", "1"))
    parser.add_argument("--node_rank", default=env.get("NODE_RANK"))
    parser.add_argument("--folders", default="", help="comma-separated: written once, read by all")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit():
        stop(f"--endpoint={args.endpoint}: expected host:port (or set MASTER_ADDR)")
    if not str(args.nnodes).isdigit() or int(args.nnodes) < 1:
        stop(f"--nnodes={args.nnodes}: a number of nodes from 1 (elastic MIN:MAX: give MAX)")
    rank = args.node_rank
    if rank is not None and not str(rank).isdigit():
        stop(f"--node_rank={rank}: a number from 0")
    folders = tuple(f for f in args.folders.split(",") if f)
    node_rank = int(rank) if rank is not None else None
    return checks.Launch(host, int(port), int(args.nnodes), node_rank, folders), args.timeout


def stop(message: str) -> NoReturn:
    """Bad flags: one line on stderr, exit 2 (on every node: the preflight runs per node, not
    per rank, so it does not ask RANK who should print)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    launch, timeout = parse(argv)
    problems = checks.local_problems(launch)
    meeting = exchange.Meeting([], -1, problems)
    if not problems:  # a node that is wrong alone does not go on to keep the others waiting
        meeting = exchange.meet(launch, timeout)
        problems = meeting.problems
    for problem in problems:
        print(f"preflight: problem: {problem}", flush=True)
    if problems:
        return 1
    print(summary(launch, meeting), flush=True)
    return 0


def summary(launch: checks.Launch, meeting: exchange.Meeting) -> str:
    nodes, me = meeting.nodes, meeting.nodes[meeting.me]
    endpoint = f"{launch.endpoint} = {network.resolve(launch.host)[0]}"
    folders = f"; shared: {', '.join(launch.folders)}" if launch.folders else ""
    return (
        f"preflight {me.hostname}: ok, {len(nodes)} of {launch.nnodes} nodes met at {endpoint}; "
        f"gloo binds {me.gloo_address}, NCCL would use {me.nccl_interface}; torch {me.torch}, "
        f"course {me.course} on every node{folders}"
    )


if __name__ == "__main__":
    sys.exit(main())
