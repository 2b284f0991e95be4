"""python -m dtl.cluster: make, use and remove the cluster of dtl/cluster/hosts.py.

python -m dtl.cluster up 2 [--slurm]     hosts node0, node1 (and Slurm's daemons on them)
python -m dtl.cluster status             the hosts, their addresses and processes
python -m dtl.cluster exec node1 CMD...  one command on one host
python -m dtl.cluster all CMD...         the same command on every host at once (a launch)
python -m dtl.cluster down               remove everything `up` made; say if anything is left
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

from dtl.cluster import hosts, launch, slurm, ssh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtl.cluster", description=__doc__)
    parser.add_argument("--prefix", default="dtl", help="names of the namespaces and links")
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("up", help="make N hosts")
    make.add_argument("n", type=int)
    make.add_argument("--slurm", action="store_true", help="start munged, slurmctld, slurmd")
    make.add_argument("--ssh", action="store_true", help="start sshd (the deepspeed launcher)")
    sub.add_parser("status", help="the hosts and what runs on them")
    one = sub.add_parser("exec", help="run a command on one host")
    one.add_argument("host")
    one.add_argument("cmd", nargs=argparse.REMAINDER)
    every = sub.add_parser("all", help="run the same command on every host at once")
    every.add_argument("--timeout", type=float, default=600)
    every.add_argument("--hosts", default="", help="comma-separated names (default: every host)")
    every.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove the cluster")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            return _up(args.prefix, args.n, args.slurm, args.ssh)
        cluster = hosts.load(args.prefix)
        if cluster is None:
            print(
                f"error: no cluster {args.prefix} is up (python -m dtl.cluster up 2)",
                file=sys.stderr,
            )
            return 2
        return ACTIONS[args.action](cluster, args)
    except (RuntimeError, ValueError, KeyError, TimeoutError) as err:  # said in one line
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2


def _up(prefix: str, n: int, with_slurm: bool, with_ssh: bool) -> int:
    problem = (
        hosts.missing_capability()
        or (with_slurm and slurm.missing_packages())
        or (with_ssh and ssh.missing_packages())
    )
    if problem:
        print(f"error: cannot build the cluster here: {problem}", file=sys.stderr)
        return 2
    cluster = hosts.up(n, prefix)
    try:
        _start_daemons(cluster, with_slurm, with_ssh)
    except BaseException:
        hosts.down(cluster)  # nothing half-made stays behind
        raise
    _print_status(cluster)
    return 0


def _start_daemons(cluster: hosts.Cluster, with_slurm: bool, with_ssh: bool) -> None:
    if with_slurm:
        slurm.start(cluster)
        print(f"slurm: SLURM_CONF={slurm.conf_path(cluster)} (exec and all set it)")
    if with_ssh:
        ssh.start(cluster)
        print(f"ssh: hostfile {ssh.hostfile(cluster, slots=1)}; `exec` runs with its ssh config")


def _print_status(cluster: hosts.Cluster, _: object = None) -> int:
    print(f"cluster {cluster.prefix}: bridge {cluster.bridge}, state in {cluster.folder}")
    for h in cluster.hosts:
        pids = cluster.processes(h)
        print(f"  {h.name:<8}{h.address:<14}namespace {h.netns}, {len(pids)} processes")
    for name, pid in cluster.daemons.items():
        print(f"  daemon {name} pid {pid}")
    print(f"  shared folder {cluster.shared}; each host's own folder at {cluster.local}")
    return 0


def _exec(cluster: hosts.Cluster, args: argparse.Namespace) -> int:
    argv = ssh.with_client_config(cluster, args.cmd) if ssh.launcher_env(cluster) else args.cmd
    env = {**_slurm_env(cluster), **ssh.launcher_env(cluster)}
    command = cluster.command(cluster.host(args.host), argv)
    return subprocess.run(command, env=hosts.host_environment(env), check=False).returncode


def _all(cluster: hosts.Cluster, args: argparse.Namespace) -> int:
    chosen = [cluster.host(n) for n in args.hosts.split(",")] if args.hosts else cluster.hosts
    commands = {h: args.cmd for h in chosen}
    results = launch.run_on_hosts(cluster, commands, _slurm_env(cluster), timeout=args.timeout)
    for r in results:
        state = "timed out" if r.timed_out else f"exit {r.returncode}"
        print(f"===== {r.host}: {state} after {r.seconds:.1f} s")
        sys.stdout.write(r.output)
    return 0 if all(r.returncode == 0 for r in results) else 1


def _slurm_env(cluster: hosts.Cluster) -> dict[str, str]:
    """SLURM_CONF for every command on a cluster that runs Slurm (sbatch, squeue, srun...)."""
    return slurm.slurm_env(cluster) if os.path.exists(slurm.conf_path(cluster)) else {}


def _down(cluster: hosts.Cluster, _: argparse.Namespace) -> int:
    hosts.down(cluster)
    left = hosts.leftovers(cluster)
    for what in left:
        print(f"left behind: {what}")
    print(f"cluster {cluster.prefix} is down" + ("" if not left else " (see above)"))
    return 1 if left else 0


Action = Callable[[hosts.Cluster, argparse.Namespace], int]
ACTIONS: dict[str, Action] = {"status": _print_status, "exec": _exec, "all": _all, "down": _down}

if __name__ == "__main__":
    sys.exit(main())
