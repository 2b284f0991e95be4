"""A tiny Slurm cluster whose "hosts" are network namespaces on one machine.

Slurm is the batch system most GPU clusters use. On a real cluster three kinds of
daemon (background programs) cooperate; here each one is a process we start ourselves
and keep the pid of, so we can stop it again:

- ``munged`` (MUNGE) signs and checks credentials. Every Slurm message carries a
  credential made with a secret key that all hosts share, so a daemon knows the
  message really came from the cluster. One ``munged`` is enough here: its socket
  is a file, and every namespace sees the same file system.
- ``slurmctld`` is the controller, the "brain". It knows the nodes, keeps the job
  queue, and decides which job runs on which nodes. It runs on the first host.
- ``slurmd`` is the node agent, one per host. It registers its node with the
  controller and starts the job's processes (through ``slurmstepd``) when told to.

The commands ``sbatch`` (queue a script), ``srun`` (start tasks on the job's nodes),
``squeue``, ``sinfo`` and ``scontrol`` are clients: they find the controller by reading
the file named in the ``SLURM_CONF`` environment variable.

Everything (slurm.conf, cgroup.conf, munge key and socket, state, logs) lives in one
folder, so nothing in /etc/slurm or /etc/munge is used, and removing the folder
removes the cluster.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dtl.cluster.hosts import Cluster, Host, host_environment
from dtl.cluster.processes import alive, stop

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol")
# each node as the course's batch file asks (day28_gpt125m/launch/slurm.sbatch: --cpus-per-task=32,
# --gpus-per-node=8): slurmd takes the configured counts (config_overrides); GPUs are counts only
BATCH_CPUS = 32
BATCH_GPUS = 8
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def missing_packages() -> str | None:
    """One line naming the Slurm/MUNGE programs not on PATH, or None if all are there."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not missing:
        return None
    return (
        f"not on PATH: {', '.join(missing)} "
        "(Debian/Ubuntu: apt-get install slurmd slurmctld slurm-client munge)"
    )


def folder_of(cluster: Cluster) -> str:
    """Where the cluster's Slurm configuration and state live."""
    return os.path.join(cluster.folder, "slurm")


def conf_path(cluster: Cluster) -> str:
    """slurm.conf in that folder: what SLURM_CONF names for every Slurm command."""
    return os.path.join(folder_of(cluster), "slurm.conf")


def slurm_env(cluster: Cluster) -> dict[str, str]:
    """What a Slurm command (sbatch, squeue, srun, ...) needs added to its environment."""
    return {"SLURM_CONF": conf_path(cluster)}


def write_config(cluster: Cluster, cpus_per_node: int = 1, gpus_per_node: int = 0) -> None:
    """Write slurm.conf, cgroup.conf, a fresh munge key and the state folders into folder.

    The first host runs the controller. `gpus_per_node` declares that many GPUs per node
    (gres.conf, each GPU an empty stand-in file for its device): a batch file asking
    --gpus-per-node is accepted as on a GPU cluster, and no device is handed out. Returns the
    """
    hosts, root = cluster.hosts, Path(folder_of(cluster)).resolve()
    # munged wants its socket folder open to all (tempfile.mkdtemp makes it 0700).
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    for sub in ["state", *(f"spool-{host.name}" for host in hosts)]:
        (root / sub).mkdir(parents=True, exist_ok=True)

    # munged refuses a key that others can read: create it with mode 0600.
    key = root / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(secrets.token_bytes(128))

    control = hosts[0]
    gres = f" Gres=gpu:{gpus_per_node}" if gpus_per_node else ""
    node_lines = [
        f"NodeName={host.name} NodeAddr={host.address} CPUs={cpus_per_node}{gres} State=UNKNOWN"
        for host in hosts
    ]
    names = ",".join(host.name for host in hosts)
    settings = [
        "ClusterName=course",
        f"SlurmctldHost={control.name}({control.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        # Credentials: ask our own munged, through its socket in this folder.
        "AuthType=auth/munge",
        f"AuthInfo=socket={root / 'munge.sock'}",
        "CredType=cred/munge",
        # State and logs stay in the folder; %n is replaced by the node name.
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobs.txt'}",
        # No cgroups, no accounting database: track processes by parent pid.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        # Trust the CPU count written here even if the machine has fewer cores.
        "SlurmdParameters=config_overrides",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Small timeouts so the toy cluster starts and notices failures quickly.
        "ReturnToService=2",
        "SlurmctldTimeout=10",
        "SlurmdTimeout=10",
        "MessageTimeout=5",
        "KillWait=5",
        "InactiveLimit=0",
        "Waittime=0",
        "MinJobAge=600",
        *(["GresTypes=gpu"] if gpus_per_node else []),
        *node_lines,
        f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP",
    ]
    Path(conf_path(cluster)).write_text("\n".join(settings) + "\n")
    # slurmd always loads a cgroup plugin; autodetection fails in containers, so name one.
    # With proctrack/linuxproc and task/none it is loaded but never used.
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    # a count alone is not enough (slurmd reports 0 GPUs and the node is drained): each GPU
    # names a device file, here an empty stand-in for /dev/nvidiaN that slurmd only stats
    devices = [root / f"gpu{i}" for i in range(gpus_per_node)]
    for device in devices:
        device.touch()
    lines = [f"NodeName={h.name} Name=gpu File={d}" for h in hosts for d in devices]
    (root / "gres.conf").write_text("\n".join(["AutoDetect=off", *lines]) + "\n")


def run_on(
    cluster: Cluster, host: Host, argv: list[str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command (sinfo, sbatch, ...) on host; output is captured."""
    return cluster.run(host, argv, timeout, env=slurm_env(cluster))


def start_daemons(cluster: Cluster, timeout: float = 60) -> list[int]:
    """Start munged, slurmctld (on hosts[0]) and one slurmd per host; wait for idle nodes.

    Returns the pids in start order. Each daemon's output (start-up errors included)
    goes to ``<daemon>.out`` in folder; slurmctld and slurmd (with the job steps'
    slurmstepd) also write ``<daemon>.log``; munged in the foreground only writes .out.
    If the nodes are not all idle within timeout seconds, or a daemon exits, the daemons
    are stopped and the error names the file to read.
    """
    hosts, root = cluster.hosts, Path(folder_of(cluster)).resolve()
    env = host_environment(slurm_env(cluster))
    socket = root / "munge.sock"
    started: list[tuple[int, Path]] = []

    def launch(argv: list[str], name: str) -> None:
        with open(root / f"{name}.out", "ab") as out:
            process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        started.append((process.pid, root / f"{name}.out"))

    munged = [
        "munged",
        "--foreground",
        f"--socket={socket}",
        f"--key-file={root / 'munge.key'}",
        f"--pid-file={root / 'munged.pid'}",
        f"--seed-file={root / 'munged.seed'}",
    ]
    try:
        launch(munged, "munged")
        _wait_for(lambda: socket.exists(), started, timeout, "munge socket")
        launch(cluster.command(hosts[0], ["slurmctld", "-D"]), "slurmctld")
        for host in hosts:
            daemon = ["slurmd", "-D", "-N", host.name]
            launch(cluster.command(host, daemon), f"slurmd-{host.name}")
        _wait_for(lambda: _all_idle(cluster), started, timeout, "all nodes idle")
    except BaseException:
        stop([pid for pid, _ in started])
        raise
    return [pid for pid, _ in started]


def wait_for_job(cluster: Cluster, job_id: str, timeout: float = 120) -> str:
    """Poll ``scontrol show job`` until the job has finished; return its final state."""
    deadline = time.monotonic() + timeout
    show = ["scontrol", "show", "job", "--oneliner", job_id]
    while True:
        shown = run_on(cluster, cluster.hosts[0], show).stdout
        fields = dict(part.split("=", 1) for part in shown.split() if "=" in part)
        state = fields.get("JobState", "UNKNOWN")
        if state in DONE_STATES:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
        time.sleep(0.5)


def _all_idle(cluster: Cluster) -> bool:
    sinfo = ["sinfo", "--noheader", "--Node", "--format=%N %t"]
    result = run_on(cluster, cluster.hosts[0], sinfo)
    states = dict(line.split(maxsplit=1) for line in result.stdout.splitlines() if " " in line)
    return result.returncode == 0 and all(states.get(h.name) == "idle" for h in cluster.hosts)


def _wait_for(
    ready: Callable[[], bool], started: list[tuple[int, Path]], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for pid, log in started:
            if not alive(pid):
                raise RuntimeError(f"a Slurm daemon (pid {pid}) exited; see {log}")
        if time.monotonic() > deadline:
            logs = ", ".join(str(log) for _, log in started)
            raise TimeoutError(f"no {what} after {timeout:.0f} s; see {logs}")
        time.sleep(0.2)


def start(
    cluster: Cluster, cpus_per_node: int = BATCH_CPUS, gpus_per_node: int = BATCH_GPUS
) -> None:
    """Write the configuration and start the daemons on the cluster's hosts; their pids are
    recorded in the cluster's state, so `down` stops them."""
    write_config(cluster, cpus_per_node, gpus_per_node)
    pids = start_daemons(cluster)
    names = ["munged", "slurmctld", *(f"slurmd-{h.name}" for h in cluster.hosts)]
    cluster.daemons.update(zip(names, pids, strict=True))
    cluster.save()
