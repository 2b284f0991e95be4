"""The checks a node can make alone, before it talks to any other: one line per problem."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from dtl.preflight import network


@dataclass(frozen=True)
class Launch:
    """What the launch line says: where the nodes meet, how many, and this node's rank if the
    line gives one (a static rendezvous, --node_rank; None under c10d, which numbers them)."""

    host: str  # --rdzv-endpoint's host or MASTER_ADDR
    port: int
    nnodes: int
    node_rank: int | None = None
    folders: tuple[str, ...] = field(default_factory=tuple)  # written once, read by every node

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def store_host_here(launch: Launch) -> bool:
    """Does this node host the meeting point? Node rank 0 under a static rendezvous; the node
    whose own address the endpoint names under c10d (torchrun's rule)."""
    if launch.node_rank is not None:
        return launch.node_rank == 0
    here = {socket.gethostname(), socket.getfqdn()}
    return launch.host in here or any(map(network.is_this_node, network.resolve(launch.host)))


def local_problems(launch: Launch, env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return [
        *endpoint_problems(launch),
        *interface_problems(env),
        *(gloo_problems(env) if launch.nnodes > 1 else []),  # one node: loopback is right
        *port_problems(launch),
    ]


def endpoint_problems(launch: Launch) -> list[str]:
    name = socket.gethostname()
    addresses = network.resolve(launch.host)
    if not addresses:
        return [f"{launch.host} (the endpoint) does not resolve on {name}: check /etc/hosts or DNS"]
    named_here = launch.node_rank == 0 or launch.host in {name, socket.getfqdn()}
    if launch.nnodes > 1 and not named_here and all(map(network.is_loopback, addresses)):
        return [
            f"{launch.host} (the endpoint) is {addresses[0]} on {name}, this node's loopback: "
            f"with {launch.nnodes} nodes, every node must name node 0's address "
            "(MASTER_ADDR=localhost only works on one node)"
        ]
    return []


def interface_problems(env: Mapping[str, str]) -> list[str]:
    name = socket.gethostname()
    present = sorted(network.interfaces())
    problems = []
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        for wanted in gloo.split(","):
            if wanted.startswith(("^", "=")):
                problems.append(
                    f"GLOO_SOCKET_IFNAME={gloo}: gloo takes interface names, not NCCL's "
                    f"{wanted[0]} syntax; name one of {', '.join(present)} on {name}"
                )
            elif wanted not in present:
                problems.append(
                    f"GLOO_SOCKET_IFNAME={gloo}: no interface {wanted} on {name} "
                    f"(it has {', '.join(present)})"
                )
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl and network.nccl_interface(nccl) is None:
        problems.append(
            f"NCCL_SOCKET_IFNAME={nccl} matches no interface with an address on {name} "
            f"(it has {', '.join(present)})"
        )
    return problems


def gloo_problems(env: Mapping[str, str]) -> list[str]:
    name = socket.gethostname()
    if not network.resolve(name):
        return [
            f"hostname {name} does not resolve on this node: torchrun's agent stops at it "
            "(socket.gaierror) and gloo would fall back to loopback; add it to /etc/hosts "
            "with the address of the interface that reaches the other nodes"
        ]
    if env.get("GLOO_SOCKET_IFNAME"):
        return []  # named: interface_problems checked it
    address = network.gloo_address(None)
    if address is None or network.is_loopback(address):
        shown = address or "no address of this node's (gloo falls back to loopback)"
        return [
            f"hostname {name} resolves to {shown}: gloo would bind it and the other nodes would "
            f"dial their own loopback; set GLOO_SOCKET_IFNAME to the interface that reaches them "
            "or map the hostname to that interface's address in /etc/hosts"
        ]
    return []


def port_problems(launch: Launch) -> list[str]:
    if not store_host_here(launch):
        return []
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", launch.port))
        except OSError as err:
            return [f"port {launch.port} on {socket.gethostname()} is taken ({err.strerror})"]
    return []
