"""Day 24 across hosts: a host dies mid-run, another takes its place, the run resumes.

    python -m dtl.cluster up 3                     (node0, node1, and node2 as the spare)
    python -m day24_checkpoint.host_drill
    python -m dtl.cluster down

node0 and node1 each start the same elastic line (c10d rendezvous at node0, --nnodes=2,
--max-restarts=3). After the first checkpoint is committed, every process of node1 is killed
at once, as a power cut would. node0's worker fails in its next all-reduce ("Connection closed
by peer"); its agent restarts it and waits in a new rendezvous round for a second node. node2
starts the same line, joins, and both resume from the last committed checkpoint. The verdict:
the losses of every step and the final parameters' sha256 equal an uninterrupted run's.

The checkpoints live in the cluster's shared folder: the replacement must read what node1 wrote.
node0 is not the one killed: it hosts the rendezvous (c10d's store lives in its agent), and its
death ends the job; a rendezvous that outlives any node needs an external store (etcd).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass

from day24_checkpoint.drill import Config as DrillConfig
from day24_checkpoint.drill import Drills, Run
from dtl.cluster import hosts, launch

PORT = 29620
STEP_SLEEP_S = 0.3  # slows each step so the kill lands mid-run (the numbers do not change)
# torch 2.13's agents share one TCPStore between rendezvous rounds; a node joining a running job
# then waits for a master address nobody writes (day 24's elastic drill): sharing off. One thread
# per process, as the reference's torchrun of 2 processes sets: one process per host would take
# every core, and its matmuls would sum in another order (other bits, not the same run)
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DTL_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class HostDrill:
    run: Run
    killed: str
    killed_after_s: float
    replacement: str
    same_as_uninterrupted: bool


def elastic_line(drills: Drills, out_dir: str) -> list[str]:
    """The line every host types: day 24's training under an elastic agent."""
    return [
        "torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=node0:{PORT}", "--rdzv-id=host-drill", "--rdzv-conf=last_call_timeout=1",
        "--max-restarts=3", "--monitor-interval=0.2",
        "-m", "day24_checkpoint.train", f"--out_dir={out_dir}", *drills.common,
        f"--step_sleep_s={STEP_SLEEP_S}",
    ]  # fmt: skip


def kill_and_replace(cluster: hosts.Cluster, drills: Drills, timeout: float = 120) -> HostDrill:
    first, victim, spare = cluster.hosts[:3]
    out_dir = os.path.join(cluster.shared, "day24-host-drill")
    shutil.rmtree(out_dir, ignore_errors=True)
    line = elastic_line(drills, out_dir)
    logs = os.path.join(cluster.folder, "logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.monotonic()
    survivor = cluster.spawn(first, line, ENV, log=os.path.join(logs, "drill-node0.log"))
    doomed = cluster.spawn(victim, line, ENV, log=os.path.join(logs, "drill-node1.log"))
    pointer = os.path.join(out_dir, "ckpt", "latest")  # day 24's commit: the last thing written
    while not os.path.exists(pointer) and survivor.poll() is None:
        if time.monotonic() - t0 > timeout:
            break
        time.sleep(0.05)
    killed_at = time.monotonic() - t0
    cluster.kill_host(victim)
    doomed.wait()
    joiner = cluster.spawn(spare, line, ENV, log=os.path.join(logs, "drill-node2.log"))
    deadline = t0 + timeout
    ends = [
        launch.wait_or_end(cluster, h, p, deadline) for h, p in ((first, survivor), (spare, joiner))
    ]
    codes = [-9 if code is None else code for code in ends]  # None: ended at the deadline
    with open(os.path.join(logs, "drill-node0.log"), errors="replace") as f:
        output = f.read()
    run = Run(max(codes, key=abs), output, out_dir, time.monotonic() - t0)
    same = run.returncode == 0 and drills.same_as_reference(run)
    return HostDrill(run, victim.name, killed_at, spare.name, same)


def main() -> int:
    cluster = hosts.load()
    if cluster is None or len(cluster.hosts) < 3:
        print("error: no cluster of 3 hosts is up (python -m dtl.cluster up 3)")
        return 2
    drills = Drills(DrillConfig(parallel="ddp", steps=12, save_every=4))
    result = kill_and_replace(cluster, drills)
    print(
        f"summary: day24 host drill: {result.killed} killed {result.killed_after_s:.1f} s in, "
        f"after the step-{drills.cfg.save_every} commit; {result.replacement} joined; resumed "
        f"from step {result.run.resumed_from}; losses and final params = uninterrupted run "
        f"{'yes' if result.same_as_uninterrupted else 'NO'}"
    )
    return 0 if result.same_as_uninterrupted else 1


if __name__ == "__main__":
    sys.exit(main())
