"""ssh between the cluster's hosts, so the deepspeed launcher can start a job on all of them.

What `deepspeed --hostfile hostfile train.py ...` does, typed once on the first node:
  1. it reads the hostfile, one line per node: "node0 slots=8" (slots: that node's GPUs;
     `--num_gpus N` keeps N of them);
  2. it checks that `ssh node0 hostname` works without a password (no prompt may appear: there
     is no one to type it), and without --master_addr asks `ssh node0 hostname -I` for the
     address the other nodes reach rank 0 at;
  3. it runs pdsh, which runs one ssh per node at once, each with one shell line:
     `export PYTHONPATH=...; export ...; cd <the folder it was started in>; python -m
     deepspeed.launcher.launch --world_info=<every node and its slots> --node_rank=%n ...`
     (pdsh writes the node's position in the list for %n: node0 0, node1 1);
  4. on each node deepspeed.launcher.launch starts one process per slot with RANK, LOCAL_RANK,
     WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun does, and passes --local_rank.
Every line a node prints comes back through pdsh with the node's name in front ("node1: ...").

What a node needs for that, and what `start` makes here in the cluster's folder:
  * an ssh daemon (sshd) on every host, listening on the host's address, with its own host key;
  * a client key whose public half the daemons accept (authorized_keys), and a known_hosts
    file naming every host's key, so no question is asked at the first connection;
  * the remote side's environment: sshd starts a fresh login shell in the home folder, with
    the system's PATH and nothing of the launching shell. The launcher forwards only a few
    variables it picks (PYTHON*, ...) and those listed in a `.deepspeed_env` file (in the home
    folder or the current one; DS_ENV_FILE names another): PATH with the same Python first,
    OMP_NUM_THREADS, DS_ACCELERATOR=cpu go there.
The launcher's ssh check calls plain `ssh`, which reads /etc/ssh/ssh_config: `client_command`
runs a command on a host with the cluster's client configuration mounted there (for that
command only), as a real cluster's nodes have it in ~/.ssh/config. Without it, pass
--no_ssh_check and --master_addr to deepspeed: pdsh alone gets the configuration through
PDSH_SSH_ARGS_APPEND.

The daemons' pids are recorded in the cluster's state: `python -m dtl.cluster down` stops them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from dtl.cluster.hosts import Cluster, Host, host_environment
from dtl.cluster.processes import alive, stop

APT_LINE = "apt-get install -y --no-install-recommends openssh-server openssh-client pdsh"
TOOLS = ("sshd", "ssh", "ssh-keygen", "pdsh")
SBIN = "/usr/sbin"  # sshd's folder, not on every PATH
PRIVSEP_DIR = "/run/sshd"  # sshd's privilege separation: its system service makes it, not apt
SYSTEM_CLIENT_CONFIG = "/etc/ssh/ssh_config"
# what every rank's environment needs on this course's CPU-only cluster
REMOTE_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
READY = "Server listening on"  # sshd -e's line once it accepts connections


def missing_packages() -> str | None:
    """One line naming the ssh/pdsh programs not installed and how to install them; None if
    all are there."""
    missing = [tool for tool in TOOLS if _which(tool) is None]
    if not missing:
        return None
    return f"not installed: {', '.join(missing)} (Debian/Ubuntu: {APT_LINE})"


def folder_of(cluster: Cluster) -> str:
    """Where the keys, configurations and sshd logs live."""
    return os.path.join(cluster.folder, "ssh")


def client_config(cluster: Cluster) -> str:
    """The ssh client configuration: the cluster's key and known hosts, never a question."""
    return os.path.join(folder_of(cluster), "ssh_config")


def start(cluster: Cluster, timeout: float = 10) -> dict[str, str]:
    """Make the keys and configurations, start one sshd per host (in its namespace) and wait
    until each listens. Returns the environment a launcher on a host needs: pdsh's transport and
    ssh options, and DS_ENV_FILE, the variables every remote side gets (REMOTE_ENV, PATH with
    this Python's folder first, DeepSpeed's prebuilt ops folder)."""
    problem = missing_packages()
    if problem:
        raise RuntimeError(problem)
    running = [name for name, pid in cluster.daemons.items() if name.startswith("sshd-")]
    if any(alive(cluster.daemons[name]) for name in running):
        raise RuntimeError(f"sshd runs already on cluster {cluster.prefix}: {running}")
    folder = folder_of(cluster)
    os.makedirs(folder, exist_ok=True)
    os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)  # sshd: "Missing privilege separation"
    key = os.path.join(folder, "id_ed25519")
    _keygen(key, "dtl-cluster")
    shutil.copyfile(f"{key}.pub", os.path.join(folder, "authorized_keys"))
    known = []
    for host in cluster.hosts:
        _keygen(_host_key(cluster, host), host.name)
        with open(f"{_host_key(cluster, host)}.pub") as f:
            kind, blob = f.read().split()[:2]
        known.append(f"{host.name},{host.address} {kind} {blob}\n")
        with open(_sshd_config(cluster, host), "w") as f:
            f.write(_sshd_text(cluster, host))
    with open(os.path.join(folder, "known_hosts"), "w") as f:
        f.writelines(known)
    with open(client_config(cluster), "w") as f:
        f.write(_client_text(folder))
    forwarded = {"PATH": host_environment()["PATH"], **_prebuilt_ops(), **REMOTE_ENV}
    with open(_env_file(cluster), "w") as f:
        f.writelines(f"{name}={value}\n" for name, value in forwarded.items())
    _start_daemons(cluster, timeout)
    return launcher_env(cluster)


def launcher_env(cluster: Cluster) -> dict[str, str]:
    """What the launching shell needs (empty when `start` has not run on this cluster): pdsh
    over ssh with the cluster's client configuration, and the remote sides' variables."""
    if not os.path.exists(client_config(cluster)):
        return {}
    return {
        "PDSH_RCMD_TYPE": "ssh",
        "PDSH_SSH_ARGS_APPEND": f"-F {client_config(cluster)}",
        "DS_ENV_FILE": _env_file(cluster),
    }


def _env_file(cluster: Cluster) -> str:
    """The deepspeed launcher's `.deepspeed_env`: the variables every remote rank gets."""
    return os.path.join(folder_of(cluster), "deepspeed_env")


def hostfile(cluster: Cluster, slots: int, hosts: list[Host] | None = None) -> str:
    """Write the deepspeed launcher's hostfile, each of `hosts` (default: every host) with
    `slots` slots; its path."""
    path = os.path.join(cluster.folder, "hostfile")
    with open(path, "w") as f:
        f.writelines(f"{host.name} slots={slots}\n" for host in hosts or cluster.hosts)
    return path


def _prebuilt_ops() -> dict[str, str]:
    """DeepSpeed's C++ ops folder, if this side has one: the remote ranks load the ops built at
    install instead of compiling their own into ~/.cache (over a minute per op)."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR")
    return {"TORCH_EXTENSIONS_DIR": folder} if folder else {}


def client_command(cluster: Cluster, host: Host, argv: list[str]) -> list[str]:
    """argv run on `host` with the cluster's client configuration as /etc/ssh/ssh_config, so a
    plain `ssh node1` (the deepspeed launcher's check) connects. The mount lives in the
    command's own mount namespace: the machine's file is untouched."""
    return cluster.command(host, with_client_config(cluster, argv))


def with_client_config(cluster: Cluster, argv: list[str]) -> list[str]:
    """argv, run with the cluster's ssh client configuration mounted over the system's."""
    mount = 'mount --bind "$1" "$2" || exit 97; shift 2; exec "$@"'
    return ["sh", "-c", mount, "sh", client_config(cluster), SYSTEM_CLIENT_CONFIG, *argv]


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=SBIN)


def _keygen(path: str, comment: str) -> None:
    for old in (path, f"{path}.pub"):
        if os.path.exists(old):
            os.remove(old)
    argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ssh-keygen {path}: {done.stderr.strip()}")


def _host_key(cluster: Cluster, host: Host) -> str:
    return os.path.join(folder_of(cluster), f"host_key-{host.name}")


def _sshd_config(cluster: Cluster, host: Host) -> str:
    return os.path.join(folder_of(cluster), f"sshd_config-{host.name}")


def _sshd_log(cluster: Cluster, host: Host) -> str:
    return os.path.join(folder_of(cluster), f"sshd-{host.name}.log")


def _sshd_text(cluster: Cluster, host: Host) -> str:
    folder = folder_of(cluster)
    settings = [
        "Port 22",
        f"ListenAddress {host.address}",
        f"HostKey {_host_key(cluster, host)}",
        f"AuthorizedKeysFile {folder}/authorized_keys",
        "PermitRootLogin prohibit-password",  # root, with a key only
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "StrictModes no",  # the folder is under /tmp, writable by all: StrictModes refuses it
        "UsePAM no",  # no PAM session setup in a sandbox
        "PrintMotd no",
        f"PidFile {folder}/sshd-{host.name}.pid",
    ]
    return "\n".join(settings) + "\n"


def _client_text(folder: str) -> str:
    settings = [
        f"IdentityFile {folder}/id_ed25519",
        "IdentitiesOnly yes",
        f"UserKnownHostsFile {folder}/known_hosts",
        "StrictHostKeyChecking yes",  # every host's key is in known_hosts already
        "BatchMode yes",  # never a prompt: fail instead
        "LogLevel ERROR",
    ]
    return "Host *\n" + "".join(f"    {line}\n" for line in settings)


def _start_daemons(cluster: Cluster, timeout: float) -> None:
    sshd = _which("sshd")
    assert sshd is not None  # missing_packages said so
    started = []
    for host in cluster.hosts:
        argv = [os.path.abspath(sshd), "-D", "-e", "-f", _sshd_config(cluster, host)]
        pid = cluster.spawn(host, argv, log=_sshd_log(cluster, host)).pid
        cluster.daemons[f"sshd-{host.name}"] = pid
        started.append((host, pid))
    cluster.save()  # recorded at once: `down` stops them even if the wait below fails
    deadline = time.monotonic() + timeout
    waiting = list(started)
    while waiting:
        host, pid = waiting[0]
        with open(_sshd_log(cluster, host), errors="replace") as f:
            log = f.read()
        if READY in log:
            waiting.pop(0)
        elif not alive(pid) or time.monotonic() > deadline:
            _stop(cluster, started)
            state = "exited" if not alive(pid) else f"not listening after {timeout:.0f} s"
            raise RuntimeError(f"sshd on {host.name} {state}: {log.strip()[-300:]}")
        else:
            time.sleep(0.05)


def _stop(cluster: Cluster, started: list[tuple[Host, int]]) -> None:
    stop([pid for _, pid in started])
    for host, _ in started:
        del cluster.daemons[f"sshd-{host.name}"]
    cluster.save()
