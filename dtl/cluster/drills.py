"""The multi-node failures people hit first, each reproduced on two hosts and then fixed.

    python -m dtl.cluster.drills [--drill=NAME]      (a cluster from `python -m dtl.cluster up 2`)

A drill is data: what is wrong (a hosts file, an interface variable, the master's address, the
node ranks), the error torch or gloo prints for it, the line the preflight (dtl.preflight)
prints for it before anything starts, and the fix. Each run is the probe (dtl.cluster.probe:
join, one all-reduce) under torchrun on both hosts, so a wrong launch shows as it would with any
training script; a static rendezvous is given an 8 s timeout so a hang is seconds, not 10 min.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from dtl.cluster import hosts, launch

PORT = 29610
STATIC_TIMEOUT_S = 8  # static rendezvous: --rdzv-conf=timeout (torch's default is 600 s)


@dataclass(frozen=True)
class Setup:
    """How both hosts launch: c10d (the rendezvous numbers the nodes) or static (MASTER_ADDR
    and --node_rank per host); extra environment; Debian's hosts file (the host's own name at
    127.0.1.1) or the cluster's; the hosts' own names, or others no hosts file holds."""

    static: bool = False
    master_addr: tuple[str, str] = ("node0", "node0")  # per host (static)
    node_rank: tuple[int, int] = (0, 1)  # per host (static)
    env: Mapping[str, str] = field(default_factory=dict)
    debian_hosts: bool = False
    hostnames: tuple[str, str] | None = None  # names the hosts file does not hold (None: theirs)


@dataclass(frozen=True)
class Drill:
    name: str
    mistake: str
    broken: Setup
    fixed: Setup
    failure: str  # regex: what the broken launch prints (torch's or gloo's own words)
    preflight: str  # regex: the preflight's line for the broken setup


DRILLS = (
    Drill(
        "hostname_unresolved",
        "each host's name is in no hosts file and no DNS (a fresh cloud image)",
        Setup(hostnames=("trainer-a", "trainer-b")),
        Setup(),
        r"socket\.gaierror: \[Errno -?\d+\]",
        r"hostname trainer-a does not resolve on this node",
    ),
    Drill(
        "loopback_hostname",
        "each host's name maps to 127.0.1.1 in /etc/hosts (Debian's default)",
        Setup(debian_hosts=True),
        Setup(debian_hosts=True, env={"GLOO_SOCKET_IFNAME": "eth0"}),
        r"Gloo connectFullMesh failed .*Connection refused, remote=\[127\.0\.1\.1\]",
        r"hostname node\d resolves to 127\.0\.1\.1: gloo would bind it",
    ),
    Drill(
        "gloo_exclusion",
        "GLOO_SOCKET_IFNAME=^lo, NCCL's exclusion syntax, given to gloo",
        Setup(env={"GLOO_SOCKET_IFNAME": "^lo"}),
        Setup(env={"GLOO_SOCKET_IFNAME": "eth0"}),
        r"Unable to find address for: \^lo",
        r"GLOO_SOCKET_IFNAME=\^lo: gloo takes interface names, not NCCL's \^ syntax",
    ),
    Drill(
        "master_localhost",
        "MASTER_ADDR=localhost on the second host (static rendezvous)",
        Setup(static=True, master_addr=("node0", "localhost")),
        Setup(static=True),
        r"timed out after \d+ms while trying to connect to \(localhost, \d+\)",
        r"localhost \(the endpoint\) is 127\.0\.0\.1 on node1, this node's loopback",
    ),
    Drill(
        "duplicate_node_rank",
        "--node_rank=0 on both hosts (static rendezvous)",
        Setup(static=True, node_rank=(0, 0)),
        Setup(static=True),
        r"wait timeout after \d+ms, keys: \S+role_info/0, \S+role_info/1",
        r"--node_rank=0 is given to 2 nodes",
    ),
)


def torchrun_line(setup: Setup, i: int) -> list[str]:
    """Host i's launch line."""
    line = ["torchrun", "--nnodes=2", "--nproc_per_node=1"]
    if setup.static:
        line += [
            f"--node_rank={setup.node_rank[i]}",
            f"--master_addr={setup.master_addr[i]}",
            f"--master_port={PORT}",
            f"--rdzv-conf=timeout={STATIC_TIMEOUT_S}",
        ]
    else:
        line += ["--rdzv-backend=c10d", f"--rdzv-endpoint=node0:{PORT}", "--rdzv-id=drill"]
    return [*line, "-m", "dtl.cluster.probe"]


def preflight_line(setup: Setup, i: int) -> list[str]:
    """Host i's preflight for the same launch."""
    line = ["python", "-m", "dtl.preflight", "--nnodes=2", f"--timeout={STATIC_TIMEOUT_S}"]
    if setup.static:
        endpoint = f"--endpoint={setup.master_addr[i]}:{PORT}"
        return [*line, endpoint, f"--node_rank={setup.node_rank[i]}"]
    return [*line, f"--endpoint=node0:{PORT}"]


@dataclass(frozen=True)
class Outcome:
    runs: list[launch.HostRun]

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.runs)

    def text(self) -> str:
        return "\n".join(r.output for r in self.runs)

    def shows(self, pattern: str) -> bool:
        return re.search(pattern, self.text()) is not None


def run(cluster: hosts.Cluster, setup: Setup, preflight: bool = False) -> Outcome:
    """The probe (or the preflight) on the cluster's first two hosts, set up as `setup` says."""
    pair = cluster.hosts[:2]
    line = preflight_line if preflight else torchrun_line
    commands = {h: line(setup, i) for i, h in enumerate(pair)}
    files = debian_hosts_files(cluster, pair) if setup.debian_hosts else None
    names = dict(zip(pair, setup.hostnames, strict=True)) if setup.hostnames else None
    env = {"DTL_TIMEOUT_S": str(STATIC_TIMEOUT_S), **setup.env}  # the probe's group, too
    timeout = 4 * STATIC_TIMEOUT_S
    runs = launch.run_on_hosts(
        cluster, commands, env, timeout=timeout, hosts_files=files, hostnames=names
    )
    return Outcome(runs)


def debian_hosts_files(cluster: hosts.Cluster, pair: list[hosts.Host]) -> dict[hosts.Host, str]:
    """Each host's /etc/hosts as Debian writes it: its own name at 127.0.1.1."""
    files = {}
    for h in pair:
        path = os.path.join(cluster.folder, f"hosts-debian-{h.name}")
        with open(path, "w") as f:
            f.write(hosts.hosts_text(cluster.hosts, {h.name: "127.0.1.1"}))
        files[h] = path
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtl.cluster.drills", description=__doc__)
    parser.add_argument("--drill", choices=[d.name for d in DRILLS] + ["all"], default="all")
    parser.add_argument("--prefix", default="dtl")
    args = parser.parse_args(argv)
    cluster = hosts.load(args.prefix)
    if cluster is None or len(cluster.hosts) < 2:
        print(f"error: no cluster {args.prefix} of 2 hosts is up (python -m dtl.cluster up 2)")
        return 2
    ok = True
    for drill in DRILLS:
        if args.drill in (drill.name, "all"):
            ok &= report(cluster, drill)
    return 0 if ok else 1


def report(cluster: hosts.Cluster, drill: Drill) -> bool:
    broken, said = run(cluster, drill.broken), run(cluster, drill.broken, preflight=True)
    fixed = run(cluster, drill.fixed)
    failed_as_documented = not broken.ok and broken.shows(drill.failure)
    print(f"drill {drill.name}: {drill.mistake}")
    print(f"  the launch: {_first_match(broken, drill.failure)}")
    print(f"  before it:  {_first_match(said, drill.preflight)}")
    print(f"  the fix:    {_first_match(fixed, r'summary: probe .*')}")
    good = failed_as_documented and said.shows(drill.preflight) and fixed.ok
    print(f"summary: drill {drill.name}: reproduced, explained, fixed {'yes' if good else 'NO'}")
    return good


def _first_match(outcome: Outcome, pattern: str) -> str:
    found = re.search(f".*{pattern}.*", outcome.text())
    return found.group(0).strip() if found else f"(no line matching {pattern!r})"


if __name__ == "__main__":
    sys.exit(main())
