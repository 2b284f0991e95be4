"""Run one command per host at once and collect what each printed: a multi-node launch.

    results = run_on_hosts(cluster, {host: argv, ...}, env, timeout=60, logs=folder)

Each host's command starts in its namespace (Cluster.spawn); all run together, as the same line
typed on every node of a real cluster. A host still running at `timeout` has every process in
its namespace killed but the cluster's daemons, and its result says so (returncode None): a
hang is a result, never a stuck test.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtl.cluster.hosts import Cluster, Host


@dataclass(frozen=True)
class HostRun:
    host: str
    returncode: int | None  # None: still running at the timeout, killed
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_on_hosts(
    cluster: Cluster,
    commands: Mapping[Host, Sequence[str]],
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    logs: str | None = None,
    hosts_files: Mapping[Host, str] | None = None,
    hostnames: Mapping[Host, str] | None = None,
) -> list[HostRun]:
    """Start every host's command, wait for all (or the timeout), return one HostRun per host.
    `env` is added to every host's environment; `hosts_files[host]` replaces that host's
    /etc/hosts and `hostnames[host]` its own name (the drills' wrong ones)."""
    logs = logs or os.path.join(cluster.folder, "logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.monotonic()
    procs = {}
    for host, argv in commands.items():
        procs[host] = cluster.spawn(
            host,
            argv,
            env=env,
            log=os.path.join(logs, f"{host.name}.log"),
            hosts_file=(hosts_files or {}).get(host),
            hostname=(hostnames or {}).get(host),
        )
    ended: dict[Host, float] = {}
    while len(ended) < len(procs) and time.monotonic() - t0 < timeout:
        for host, proc in procs.items():
            if host not in ended and proc.poll() is not None:
                ended[host] = time.monotonic() - t0
        time.sleep(0.05)
    results = []
    for host, proc in procs.items():
        code = wait_or_end(cluster, host, proc, deadline=t0 + timeout)
        with open(os.path.join(logs, f"{host.name}.log"), errors="replace") as f:
            output = f.read()
        results.append(HostRun(host.name, code, output, ended.get(host, timeout)))
    return results


def wait_or_end(
    cluster: Cluster, host: Host, proc: subprocess.Popen[bytes], deadline: float
) -> int | None:
    """proc's exit code once it ends; None if it still runs at `deadline` (time.monotonic()),
    when everything it started on its host is ended (torchrun's workers run in sessions of their
    own: killing the agent alone leaves them), the cluster's daemons spared."""
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None:
        return proc.returncode
    cluster.end_runs(host)
    proc.kill()
    proc.wait()
    return None
