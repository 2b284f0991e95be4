"""Two hosts for real: network namespaces with their own hostnames and addresses (dtl.cluster).

The suite keeps the cluster's life cycle and one two-host torchrun: day 28's two-node launch
script, typed on both hosts, trains equal to one process. The failure drills and Slurm run in
`make cluster` (tests/test_cluster_drills.py). Without root or CAP_NET_ADMIN, each skips in one
line naming what is missing.
"""

import os

import pytest

from dtl.cluster import hosts, launch

PREFIX = "dtltest"
NEEDS = hosts.missing_capability()
needs_cluster = pytest.mark.skipif(NEEDS is not None, reason=f"no cluster here: {NEEDS}")


def test_without_root_the_cluster_names_what_is_missing_in_one_line(monkeypatch):
    monkeypatch.setattr(hosts.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    assert hosts.missing_capability() == "not root: namespaces, links and mounts need root"


@pytest.fixture(scope="module")
def cluster():
    stale = hosts.load(PREFIX)
    if stale is not None:  # an earlier run killed before its teardown
        hosts.down(stale)
    made = hosts.up(2, PREFIX)
    yield made
    hosts.down(made)
    assert hosts.leftovers(made) == [], "the cluster left something behind"


@needs_cluster
def test_each_host_has_its_own_name_address_and_local_folder_and_sees_the_others(cluster):
    for h in cluster.hosts:
        marker = os.path.join(cluster.local, f"written-on-{h.name}")
        done = cluster.run(h, ["sh", "-c", f"hostname; getent hosts node0 node1; touch {marker}"])
        assert done.returncode == 0, done.stderr
        name, *resolved = done.stdout.splitlines()
        assert name == h.name
        assert [line.split()[0] for line in resolved] == [x.address for x in cluster.hosts]
    # each host wrote into "the same" local folder: each finds only its own file there
    for h in cluster.hosts:
        done = cluster.run(h, ["ls", cluster.local])
        assert done.stdout.split() == [f"written-on-{h.name}"]
    assert not os.listdir(cluster.local), "a host's local folder leaked into the machine's"


@needs_cluster
def test_up_and_down_leave_nothing_behind():
    made = hosts.up(2, PREFIX + "x")
    try:
        assert hosts.leftovers(made), "leftovers() must see a cluster that is up"
        victim = made.spawn(made.hosts[1], ["sleep", "60"])
    finally:
        hosts.down(made)
    assert victim.wait(timeout=5) == -9  # killed inside its host's namespace (ip netns pids)
    assert hosts.leftovers(made) == []


@needs_cluster
def test_day28_two_node_script_on_two_hosts_trains_equal_to_one_process(cluster):
    # the line of day28_gpt125m/launch/train_2node.sh, typed on both hosts; CONFIG= keeps the
    # script's CPU defaults (the tiny GPT), and the run checks itself against one process
    script = ["bash", "day28_gpt125m/launch/train_2node.sh", "--steps=4", "--workers=0"]
    env = dict(CONFIG="", RDZV_HOST="node0", GPUS_PER_NODE="1", RDZV_ID="test-two-hosts")
    runs = launch.run_on_hosts(cluster, {h: script for h in cluster.hosts}, env, timeout=120)
    node0, node1 = runs
    assert node0.returncode == 0 and node1.returncode == 0, node0.output[-2000:]
    for run in runs:  # the script's preflight met the other host first
        assert f"preflight {run.host}: ok, 2 of 2 nodes met at node0:29500" in run.output
    assert "2 hosts: node0 (rank 0), node1 (rank 1)" in node0.output
    assert "summary: day28 fsdp2 tiny on 2 ranks" in node0.output
    assert "losses match one process yes" in node0.output, node0.output[-2000:]
