"""Multi-node failures reproduced on a cluster of three hosts, each explained and then fixed;
Slurm runs the course's batch file and the deepspeed launcher its script on two of them (`make
cluster`, deselected by `make test`).

Each drill asserts three things: the broken launch fails with torch's or gloo's own words, the
preflight says what is wrong in one line before anything starts, and the fixed launch passes.
"""

import os
import re
import subprocess
import time

import pytest

from day24_checkpoint import host_drill
from day24_checkpoint.drill import Config as DrillConfig
from day24_checkpoint.drill import Drills
from dtl.cluster import drills, hosts, launch, slurm, ssh

NEEDS = hosts.missing_capability()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(NEEDS is not None, reason=f"no cluster here: {NEEDS}"),
]
PREFIX = "dtldrill"


@pytest.fixture(scope="module")
def cluster():
    stale = hosts.load(PREFIX)
    if stale is not None:
        hosts.down(stale)
    made = hosts.up(3, PREFIX)  # node2: the spare that replaces a killed host
    yield made
    hosts.down(made)
    assert hosts.leftovers(made) == []


@pytest.mark.parametrize("drill", drills.DRILLS, ids=[d.name for d in drills.DRILLS])
def test_each_failure_is_reproduced_named_by_the_preflight_and_fixed(cluster, drill):
    broken = drills.run(cluster, drill.broken)
    assert not broken.ok and broken.shows(drill.failure), broken.text()[-3000:]
    said = drills.run(cluster, drill.broken, preflight=True)
    assert not said.ok and said.shows(drill.preflight), said.text()
    assert all(r.seconds < drills.STATIC_TIMEOUT_S + 5 for r in said.runs), "preflight hung"
    for r in said.runs:  # one line per problem, nothing else: torch's own logs stay out of it
        lines = [x for x in r.output.splitlines() if x and not x.startswith("[W")]
        assert all(x.startswith("preflight: problem: ") for x in lines), r.output
    fixed = drills.run(cluster, drill.fixed)
    assert fixed.ok and fixed.shows(r"summary: probe 2 hosts: node0 \(rank 0\), node1 \(rank 1\)")
    assert drills.run(cluster, drill.fixed, preflight=True).ok  # and the preflight passes it


def test_the_preflight_passes_a_good_launch_and_names_a_folder_only_one_node_sees(cluster):
    line = ["python", "-m", "dtl.preflight", "--nnodes=2", "--endpoint=node0:29630"]
    pair = cluster.hosts[:2]
    good = launch.run_on_hosts(cluster, {h: [*line, f"--folders={cluster.shared}"] for h in pair})
    assert [r.returncode for r in good] == [0, 0], good[0].output
    assert all("ok, 2 of 2 nodes met at node0:29630 = 10.77.0.1" in r.output for r in good)
    folders = f"--folders={cluster.shared},{cluster.local}"
    bad = launch.run_on_hosts(cluster, {h: [*line, folders] for h in pair})
    for r, other in zip(bad, ("node1", "node0"), strict=True):
        problems = [x for x in r.output.splitlines() if x.startswith("preflight: problem:")]
        assert problems == [
            f"preflight: problem: folder {cluster.local} is not shared: {r.host} cannot see "
            f"what {other} wrote there; put it on a file system every node mounts"
        ]


def _day28_two_hosts(cluster, *flags):
    script = ["bash", "day28_gpt125m/launch/train_2node.sh", "--steps=2", "--workers=0", *flags]
    env = dict(CONFIG="", RDZV_HOST="node0", GPUS_PER_NODE="1", RDZV_ID="drill-folder")
    return launch.run_on_hosts(cluster, {h: script for h in cluster.hosts[:2]}, env, timeout=90)


def test_data_written_where_the_other_host_cannot_read_stops_in_one_line(cluster):
    local = os.path.join(cluster.local, "shards")
    runs = _day28_two_hosts(cluster, f"--data_dir={local}", f"--out_dir={cluster.local}/run")
    assert all(r.returncode not in (0, None) for r in runs)
    line = f"error: data folder {local} is not shared by every node: node 0 cannot see"
    assert line in runs[0].output, runs[0].output[-2000:]
    shared = os.path.join(cluster.shared, "shards")
    runs = _day28_two_hosts(cluster, f"--data_dir={shared}", f"--out_dir={cluster.shared}/run")
    assert [r.returncode for r in runs] == [0, 0], runs[0].output[-2000:]
    assert "losses match one process yes" in runs[0].output


def test_a_checkpoint_folder_only_one_host_sees_stops_day24_in_one_line(cluster):
    line = host_drill.elastic_line(Drills(DrillConfig()), os.path.join(cluster.local, "ckpt"))
    line = [w for w in line if not w.startswith("--max-restarts")]  # it fails alike each time
    runs = launch.run_on_hosts(cluster, {h: line for h in cluster.hosts[:2]}, timeout=60)
    assert all(r.returncode not in (0, None) for r in runs)
    assert f"error: checkpoint folder {cluster.local}/ckpt/ckpt is not shared" in runs[0].output


def test_a_killed_host_is_replaced_and_the_run_resumes_equal_to_an_uninterrupted_one(cluster):
    drills_ = Drills(DrillConfig(parallel="ddp", steps=12, save_every=4))
    result = host_drill.kill_and_replace(cluster, drills_)
    assert result.run.returncode == 0, result.run.output[-3000:]
    assert "Connection closed by peer" in result.run.output  # the survivor saw the host go
    assert result.run.resumed_from == 4
    assert result.same_as_uninterrupted


def test_slurm_runs_the_course_batch_file_on_two_nodes_equal_to_one_process(cluster):
    missing = slurm.missing_packages()
    if missing:
        pytest.skip(f"no Slurm here: {missing}")
    slurm.start(cluster)  # nodes as the batch file asks for them: 32 CPUs, 8 GPUs (counts)
    node0 = cluster.hosts[0]
    env = {**slurm.slurm_env(cluster), "CONFIG": "", "GPUS_PER_NODE": "1", "STEPS": "2"}

    def on_node0(*argv):
        return cluster.run(node0, list(argv), env=env).stdout

    job = on_node0("sbatch", "--parsable", "day28_gpt125m/launch/slurm.sbatch", "--workers=0")
    job = job.strip()
    assert job.isdigit(), job
    queue = ""
    for _ in range(100):  # squeue while it runs: R on node[0-1]
        queue = on_node0("squeue", "--noheader", "--format=%i %T %D %N")
        if "RUNNING" in queue or not queue.strip():
            break
        time.sleep(0.1)
    state = slurm.wait_for_job(cluster, job)
    assert state == "COMPLETED"
    assert f"{job} RUNNING 2 node[0-1]" in queue, queue
    shown = on_node0("scontrol", "show", "job", job)
    assert "NodeList=node[0-1]" in shown and "ExitCode=0:0" in shown
    with open(f"outputs/day28_gpt125m/slurm-{job}.out") as f:
        output = f.read()
    assert "2 hosts: node0 (rank 0), node1 (rank 1)" in output
    assert "losses match one process yes" in output, output[-2000:]


def test_the_deepspeed_launcher_runs_the_course_script_on_two_hosts_equal_to_one_process(cluster):
    missing = ssh.missing_packages()
    if missing:
        pytest.skip(f"no ssh or pdsh here: {missing}")
    env = ssh.start(cluster)  # an sshd per host; pdsh's ssh options; the ranks' environment
    node0, node1 = cluster.hosts[:2]
    hostfile = ssh.hostfile(cluster, slots=1, hosts=[node0, node1])
    script = ["bash", "day28_gpt125m/launch/deepspeed.sh", "--workers=0"]
    env.update(HOSTFILE=hostfile, GPUS_PER_NODE="1", CONFIG="", STEPS="2")
    done = subprocess.run(
        ssh.client_command(cluster, node0, script),
        env=hosts.host_environment(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "node0: 2 hosts: node0 (rank 0), node1 (rank 1)" in output  # pdsh names each line
    assert re.search(
        r"node0: summary: day28 zero3 \S+ on 2 ranks .*losses match one process yes", output
    )


def test_day15s_two_node_line_runs_every_collective_across_two_hosts(cluster):
    # the line day 15's notes run on two hosts, two processes on each
    line = ["torchrun", "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d"]
    line += ["--rdzv-endpoint=node0:29500", "-m", "day15_collectives.collectives"]
    node0, node1 = launch.run_on_hosts(cluster, {h: line for h in cluster.hosts[:2]}, timeout=90)
    assert node0.returncode == 0 and node1.returncode == 0, node0.output[-2000:]
    table = [x.split() for x in node0.output.splitlines() if re.match(r"\s+\d+\s+\d+\s+node", x)]
    assert [row[:3] for row in table] == [
        ["0", "0", "node0"], ["1", "1", "node0"], ["2", "0", "node1"], ["3", "1", "node1"]
    ]  # fmt: skip
    assert re.search(r"^summary: collectives (\d+)/\1 checks passed on 4 ranks", node0.output, re.M)
