"""python -m dtl.preflight: run on every node before the launch line; exit 0 when all is well.

    python -m dtl.preflight --nnodes=2 --endpoint=node0:29500 [--node_rank=1] [--folders=a,b]

Without flags it reads torchrun's static variables: MASTER_ADDR, MASTER_PORT, NNODES,
NODE_RANK. Each problem is one line starting "preflight: problem:"; then exit 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from dtl.dist import exit_with_error
from dtl.preflight import checks, exchange, network

DEFAULT_TIMEOUT_S = 60.0


def parse(argv: list[str] | None) -> tuple[checks.Launch, float]:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m dtl.preflight", description=__doc__)
    default_endpoint = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '29500')}"
    parser.add_argument("--endpoint", default=default_endpoint, help="host:port where nodes meet")
    parser.add_argument("--nnodes", type=int, default=int(env.get("NNODES", "1")))
    rank = env.get("NODE_RANK")
    parser.add_argument("--node_rank", type=int, default=int(rank) if rank else None)
    parser.add_argument("--folders", default="", help="comma-separated: written once, read by all")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit():
        exit_with_error(f"--endpoint={args.endpoint}: expected host:port (or set MASTER_ADDR)")
    if args.nnodes < 1:
        exit_with_error(f"--nnodes={args.nnodes}: at least 1")
    folders = tuple(f for f in args.folders.split(",") if f)
    return checks.Launch(host, int(port), args.nnodes, args.node_rank, folders), args.timeout


def main(argv: list[str] | None = None) -> int:
    launch, timeout = parse(argv)
    problems = checks.local_problems(launch)
    nodes: list[exchange.NodeFacts] = []
    if not problems:  # a node that is wrong alone does not go on to keep the others waiting
        nodes, problems = exchange.meet(launch, timeout)
    for problem in problems:
        print(f"preflight: problem: {problem}", flush=True)
    if problems:
        return 1
    print(summary(launch, nodes), flush=True)
    return 0


def summary(launch: checks.Launch, nodes: list[exchange.NodeFacts]) -> str:
    me = next(n for n in nodes if n.hostname == socket.gethostname())
    endpoint = f"{launch.host}:{launch.port} = {network.resolve(launch.host)[0]}"
    folders = f"; shared: {', '.join(launch.folders)}" if launch.folders else ""
    return (
        f"preflight {me.hostname}: ok, {len(nodes)} of {launch.nnodes} nodes met at {endpoint}; "
        f"gloo binds {me.gloo_address}, NCCL would use {me.nccl_interface}; torch {me.torch}, "
        f"course {me.course} on every node{folders}"
    )


if __name__ == "__main__":
    sys.exit(main())
