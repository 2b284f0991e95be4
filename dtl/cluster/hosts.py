"""Hosts as network namespaces: what `up` makes, how a command runs on a host, what `down` removes.

A host here is three things a real node has and a process on this machine normally shares:
  * a network: its own namespace (`ip netns`), one interface eth0 with its own address, joined
    to the other hosts by a bridge (a switch in software);
  * a name: its own UTS namespace, so socket.gethostname() says node1 on node1;
  * a hosts file: /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts.
The file system stays shared, as a cluster's shared file system is, except one folder per host
(`Cluster.local`), private to it, mounted at the same path on every host: a node's local disk.

Everything `up` makes is recorded in <tmp>/dtl-cluster-<prefix>/state.json, and `down` removes
exactly that: the processes inside each namespace (by pid), the namespaces, the links, the
hosts files and the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from dtl.cluster.processes import alive, send_signal, stop

SUBNET = "10.77.0"  # the course's test hosts: 10.77.0.1, 10.77.0.2, ... on this machine only
ETC_NETNS = "/etc/netns"
KILL_ROUNDS = 50  # kill_host's passes: processes that fork while they are killed
CAP_NET_ADMIN = 12  # bits of /proc/self/status CapEff
CAP_SYS_ADMIN = 21


@dataclass(frozen=True)
class Host:
    name: str  # its hostname: node0
    netns: str  # its network namespace: dtl-node0
    address: str  # eth0's address inside it
    link: str  # the veth end on the bridge, outside the namespace


@dataclass
class Cluster:
    prefix: str
    folder: str  # configuration and state: state.json, hosts files, private folders, Slurm's
    bridge: str
    hosts: list[Host]
    daemons: dict[str, int] = field(default_factory=dict)  # name -> pid (munged, slurmctld, ...)

    @property
    def local(self) -> str:
        """A path every host has, backed by a different folder on each: a node's local disk."""
        return os.path.join(self.folder, "local")

    @property
    def shared(self) -> str:
        """A path every host sees the same: the shared file system."""
        return os.path.join(self.folder, "shared")

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name} in cluster {self.prefix}: {[h.name for h in self.hosts]}")

    def hosts_file(self, host: Host) -> str:
        return os.path.join(ETC_NETNS, host.netns, "hosts")

    def private_folder(self, host: Host) -> str:
        return os.path.join(self.folder, "private", host.name)

    def command(
        self,
        host: Host,
        argv: Sequence[str],
        hosts_file: str | None = None,
        hostname: str | None = None,
    ) -> list[str]:
        """argv run on `host`: in its network namespace, with its hostname and its local folder
        (`hosts_file` over /etc/hosts, `hostname` for its own: the drills' wrong ones)."""
        prologue = (
            'hostname "$1" && mount --bind "$2" "$3" || exit 97; '
            'if [ -n "$4" ]; then mount --bind "$4" /etc/hosts || exit 97; fi; '
            'shift 4; exec "$@"'
        )
        return [
            "ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", prologue, "sh",
            hostname or host.name, self.private_folder(host), self.local, hosts_file or "", *argv,
        ]  # fmt: skip

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: str | None = None,
        hosts_file: str | None = None,
        hostname: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start argv on `host` (its output to `log`, else discarded); the caller waits."""
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
        try:
            return subprocess.Popen(
                self.command(host, argv, hosts_file, hostname),
                env=host_environment(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()

    def run(
        self,
        host: Host,
        argv: Sequence[str],
        timeout: float | None = 60,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv on `host` to the end; its output as text."""
        return subprocess.run(
            self.command(host, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=host_environment(env),
        )

    def processes(self, host: Host) -> list[int]:
        """The pids inside the host's network namespace (everything it runs)."""
        out = subprocess.run(
            ["ip", "netns", "pids", host.netns], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, host: Host, spare: Sequence[int] = ()) -> list[int]:
        """End every process of the host (but `spare`), as a power cut would, again until none
        is left (a process may fork while the others die); the pids it killed."""
        killed: list[int] = []
        for _ in range(KILL_ROUNDS):
            pids = [p for p in self.processes(host) if p not in spare and alive(p)]
            if not pids:
                break
            for pid in pids:
                send_signal(pid, signal.SIGKILL)
            killed += pids
            time.sleep(0.02)
        return killed

    def end_runs(self, host: Host) -> list[int]:
        """Kill what a command started on the host, leaving the cluster's daemons running."""
        return self.kill_host(host, spare=list(self.daemons.values()))

    def save(self) -> None:
        with open(os.path.join(self.folder, "state.json"), "w") as f:
            json.dump(asdict(self), f, indent=1)


def host_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with this interpreter's bin first on PATH (torchrun, the same
    Python on every host, as a cluster's shared image gives), plus `extra`."""
    path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **(extra or {})}


def state_folder(prefix: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"dtl-cluster-{prefix}")


def missing_capability() -> str | None:
    """One line naming what this machine lacks to build the cluster; None when it can."""
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2 / util-linux)"
    if os.geteuid() != 0:
        return "not root: namespaces, links and mounts need root"
    caps = _effective_capabilities()
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps >> bit & 1:
            return f"no {name}: network namespaces need it (a container without --privileged)"
    return None


def _effective_capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def up(n: int, prefix: str = "dtl") -> Cluster:
    """Make n hosts node0..node{n-1} at SUBNET.1..SUBNET.n on one bridge; record them."""
    if load(prefix) is not None:
        raise RuntimeError(f"cluster {prefix} is up already: `python -m dtl.cluster down` first")
    if not 1 <= n <= 200:
        raise ValueError(f"hosts: 1 to 200, not {n}")
    hosts = [
        Host(f"node{i}", f"{prefix}-node{i}", f"{SUBNET}.{i + 1}", f"{prefix}-v{i}")
        for i in range(n)
    ]
    cluster = Cluster(prefix, state_folder(prefix), f"{prefix}-br0", hosts)
    taken = _names_in_use(cluster)
    if taken:  # made by something else: never ours to remove on a rollback
        raise RuntimeError(f"{', '.join(taken)} exist already on this machine: another prefix")
    os.makedirs(cluster.local)
    os.makedirs(cluster.shared)
    cluster.save()  # recorded before anything is made: `down` finds a half-made cluster too
    try:
        _ip("link", "add", cluster.bridge, "type", "bridge")
        _ip("link", "set", cluster.bridge, "up")
        for host in hosts:
            _make_host(cluster, host)
    except BaseException:
        down(cluster)
        raise
    return cluster


def _names_in_use(cluster: Cluster) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = _link_names()
    taken = [h.netns for h in cluster.hosts if h.netns in namespaces.split()]
    taken += [name for name in (cluster.bridge, *(h.link for h in cluster.hosts)) if name in links]
    return taken


def _link_names() -> set[str]:
    """The machine's link names (`ip -o link`: "3: dtl-v0@if2: <...>")."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _make_host(cluster: Cluster, host: Host) -> None:
    _ip("netns", "add", host.netns)
    _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
    _ip("link", "set", host.link, "master", cluster.bridge, "up")
    _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
    _ip("-n", host.netns, "link", "set", "eth0", "up")
    _ip("-n", host.netns, "link", "set", "lo", "up")
    os.makedirs(cluster.private_folder(host))
    os.makedirs(os.path.dirname(cluster.hosts_file(host)), exist_ok=True)
    with open(cluster.hosts_file(host), "w") as f:
        f.write(hosts_text(cluster.hosts))


def hosts_text(hosts: Sequence[Host], overrides: Mapping[str, str] | None = None) -> str:
    """An /etc/hosts naming every host at its address (`overrides`: name -> another address)."""
    lines = ["127.0.0.1\tlocalhost"]
    lines += [f"{(overrides or {}).get(h.name, h.address)}\t{h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


def load(prefix: str = "dtl") -> Cluster | None:
    """The cluster `up` recorded under this prefix, or None."""
    path = os.path.join(state_folder(prefix), "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        state = json.load(f)
    state["hosts"] = [Host(**h) for h in state["hosts"]]
    return Cluster(**state)


def down(cluster: Cluster) -> None:
    """Remove what `up` (and the daemons' start) recorded: processes, namespaces, links, files."""
    stop(list(cluster.daemons.values()))  # in the order they started: munged first, last
    for host in cluster.hosts:  # what is left: jobs' tasks, runs
        if os.path.exists(f"/run/netns/{host.netns}"):
            cluster.kill_host(host)
    for host in cluster.hosts:
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host.link], capture_output=True, check=False)
        shutil.rmtree(os.path.dirname(cluster.hosts_file(host)), ignore_errors=True)
    subprocess.run(["ip", "link", "del", cluster.bridge], capture_output=True, check=False)
    _unmount_under(cluster.folder)
    shutil.rmtree(cluster.folder, ignore_errors=True)


def leftovers(cluster: Cluster) -> list[str]:
    """What of the cluster is still on the machine (after `down`: nothing)."""
    left = [f"name {name}" for name in _names_in_use(cluster)]  # namespaces, links, bridge
    for host in cluster.hosts:
        if os.path.exists(os.path.dirname(cluster.hosts_file(host))):
            left.append(f"folder {os.path.dirname(cluster.hosts_file(host))}")
    if os.path.exists(cluster.folder):
        left.append(f"folder {cluster.folder}")
    left += [f"process {name} {pid}" for name, pid in cluster.daemons.items() if alive(pid)]
    return left


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _unmount_under(folder: str) -> None:
    """Unmount anything still mounted under the folder in this namespace (none, normally: each
    host's mounts live in the mount namespaces of its processes and end with them)."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(folder + "/")]
    for point in sorted(points, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
