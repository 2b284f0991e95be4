"""The nodes meet at the endpoint through a TCPStore, as torchrun's agents will, and compare.

Each node adds itself (its join number), writes a marker file into every given folder, posts
what it knows about itself, waits for every node's post, and then checks what only the nodes
together can see: one node rank taken twice, one hostname on two nodes, torch or the course at
different versions, a folder in which a node cannot see another node's marker (not shared).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from dtl.preflight import network
from dtl.preflight.checks import Launch, store_host_here

PREFIX = "dtl-preflight"


@dataclass(frozen=True)
class NodeFacts:
    hostname: str
    node_rank: int | None
    torch: str
    course: str
    gloo_address: str | None
    nccl_interface: str | None
    markers: dict[str, str]  # folder -> the marker file this node wrote there


def my_facts(launch: Launch, markers: dict[str, str]) -> NodeFacts:
    return NodeFacts(
        hostname=socket.gethostname(),
        node_rank=launch.node_rank,
        torch=torch.__version__,
        course=course_version(),
        gloo_address=network.gloo_address(os.environ.get("GLOO_SOCKET_IFNAME")),
        nccl_interface=network.nccl_interface(os.environ.get("NCCL_SOCKET_IFNAME")),
        markers=markers,
    )


def course_version() -> str:
    """The course's version and, in a checkout, its commit (nodes must run the same code)."""
    try:
        release = version("distributed-training-lessons")
    except PackageNotFoundError:
        release = "unknown"
    head = os.path.join(os.path.dirname(__file__), "..", "..", ".git", "HEAD")
    return f"{release}+{_commit(head)}" if os.path.exists(head) else release


def _commit(head: str) -> str:
    with open(head) as f:
        ref = f.read().strip()
    if not ref.startswith("ref: "):
        return ref[:10]
    path = os.path.join(os.path.dirname(head), ref[5:])
    if not os.path.exists(path):
        return "unknown"
    with open(path) as f:
        return f.read().strip()[:10]


@dataclass(frozen=True)
class Meeting:
    nodes: list[NodeFacts]  # every node's facts, in join order (empty if they never all met)
    me: int  # this node's place among them
    problems: list[str]


def meet(launch: Launch, timeout: float) -> Meeting:
    """Every node's facts and the problems this node sees; a node that cannot reach the
    endpoint, nodes that never arrive and more nodes than --nnodes are problems too."""
    here, name, endpoint = store_host_here(launch), socket.gethostname(), launch.endpoint
    if not here and not _reachable(launch.host, launch.port, timeout):
        # c10d's own client would log a stack per retry: one line instead
        return _failed(
            f"{name} cannot reach {endpoint} within {timeout:.0f} s: is node 0's preflight "
            "running, and is the port open between the nodes?"
        )
    try:
        store = dist.TCPStore(
            launch.host,
            launch.port,
            is_master=here,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except RuntimeError as err:  # c10d's DistError is a RuntimeError
        return _failed(f"{name} cannot use {endpoint}: {_first_line(err)}")
    markers: dict[str, str] = {}
    try:
        write_markers(launch.folders, markers)
        return _exchange(store, launch, here, markers, timeout)
    except OSError as err:  # a folder this node cannot write
        return _failed(f"cannot write to {err.filename} on {name}: {err.strerror}")
    except RuntimeError as err:  # c10d's errors are RuntimeErrors: the store's host went away
        return _failed(f"{name} lost {endpoint}: {_first_line(err)}")
    finally:
        remove_markers(markers)


def _failed(problem: str, me: int = -1) -> Meeting:
    return Meeting([], me, [problem])


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _reachable(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def _exchange(
    store: dist.TCPStore, launch: Launch, here: bool, markers: dict[str, str], timeout: float
) -> Meeting:
    me = store.add(f"{PREFIX}/joined", 1) - 1
    if me >= launch.nnodes:  # not counted among those the store's host waits for
        return _failed(f"more than {launch.nnodes} nodes reached {launch.endpoint}", me)
    store.set(f"{PREFIX}/node/{me}", json.dumps(asdict(my_facts(launch, markers))))
    keys = [f"{PREFIX}/node/{i}" for i in range(launch.nnodes)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: a timeout
        joined = store.add(f"{PREFIX}/joined", 0)
        return _failed(
            f"only {joined} of {launch.nnodes} nodes reached {launch.endpoint} within "
            f"{timeout:.0f} s (seen from {socket.gethostname()}): check every node's endpoint, "
            "--nnodes and firewall",
            me,
        )
    nodes = [NodeFacts(**json.loads(store.get(k))) for k in keys]
    problems = [*together_problems(nodes), *folder_problems(nodes, me)]
    store.add(f"{PREFIX}/looked", 1)  # the markers stay until every node has looked
    _wait_count(store, f"{PREFIX}/looked", launch.nnodes, timeout)
    store.add(f"{PREFIX}/left", 1)
    if here:  # the store lives until every node is done with it
        _wait_count(store, f"{PREFIX}/left", launch.nnodes, timeout)
    return Meeting(nodes, me, problems)


def together_problems(nodes: list[NodeFacts]) -> list[str]:
    problems = []
    ranks = Counter(n.node_rank for n in nodes if n.node_rank is not None)
    problems += [
        f"--node_rank={r} is given to {count} nodes: each node needs its own (0 to "
        f"{len(nodes) - 1}), or let c10d number them"
        for r, count in sorted(ranks.items())
        if count > 1
    ]
    names = Counter(n.hostname for n in nodes)
    problems += [
        f"hostname {name} is on {count} nodes: whatever tells nodes apart by name (a hostfile, "
        "Slurm, the logs, which ranks share a host) sees one node; give each node its own"
        for name, count in sorted(names.items())
        if count > 1
    ]
    for what in ("torch", "course"):
        versions = sorted({getattr(n, what) for n in nodes})
        if len(versions) > 1:
            by_node = ", ".join(f"{n.hostname} {getattr(n, what)}" for n in nodes)
            problems.append(f"{what} differs between nodes: {by_node}")
    return problems


def folder_problems(nodes: list[NodeFacts], me: int) -> list[str]:
    """Markers of the other nodes this node cannot see: the folder is not shared."""
    problems = []
    here = socket.gethostname()
    for folder, _ in nodes[me].markers.items():
        unseen = [
            n.hostname
            for i, n in enumerate(nodes)
            if i != me and not os.path.exists(n.markers.get(folder, ""))
        ]
        if unseen:
            problems.append(
                f"folder {os.path.abspath(folder)} is not shared: {here} cannot see what "
                f"{', '.join(unseen)} wrote there; put it on a file system every node mounts"
            )
    return problems


def write_markers(folders: tuple[str, ...], markers: dict[str, str]) -> None:
    """A marker file in each folder, named in `markers` as it is written (a folder that fails
    leaves the ones before it listed, for remove_markers)."""
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f".{PREFIX}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
        with open(path, "w") as f:
            f.write(socket.gethostname())
        markers[folder] = os.path.abspath(path)


def remove_markers(markers: dict[str, str]) -> None:
    for path in markers.values():
        if os.path.exists(path):
            os.remove(path)


def _wait_count(store: dist.TCPStore, key: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.05)
