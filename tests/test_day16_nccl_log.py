"""Day 16: the NCCL log parser, one hand-written fixture per feature (in NCCL's line formats,
see the comment at the top of each file), a multi-node one and a hang included."""

import os

import pytest

from day16_nccl import nccl_log

LOGS = os.path.join(os.path.dirname(nccl_log.__file__), "nccl_logs")


def _parse(*names):
    return nccl_log.parse_files([os.path.join(LOGS, n) for n in names])


def test_version_and_ranks_to_host_and_device():
    rep = _parse("init.log")
    assert rep.version == "2.26.2+cuda12.2"
    assert rep.ranks[0] == dict(
        host="gpu-node-a", pid=4101, dev=0, bus_id="18000", nranks=2, nnodes=1, local_rank=0
    )
    assert rep.ranks[1]["dev"] == 1 and rep.ranks[1]["bus_id"] == "2a000"


def test_transport_per_peer_pair():
    rep = _parse("transports.log")
    assert rep.transports[(0, 1)] == {"P2P/CUMEM"}
    assert rep.transports[(1, 2)] == {"SHM"}
    assert rep.transports[(3, 0)] == {"SHM"}
    assert nccl_log.transport_class("P2P/direct pointer/read") == "P2P/direct pointer"
    assert nccl_log.transport_class("NET/IBext_v8/0/GDRDMA") == "NET/IBext_v8"


def test_channels_rings_and_trees():
    rep = _parse("graph.log")
    assert rep.n_channels == 2
    assert rep.rings == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert rep.trees[0][0] == ([1], -1) and rep.trees[0][2] == ([3], 1)
    assert rep.trees[1][3] == ([], 2)
    ring, tree = rep.graphs  # the two searched graphs, each once although 4 ranks could print it
    assert ring["pattern"] == "ring" and tree["pattern"] == "balanced tree"
    assert ring["path_intra"] == "NVL" and ring["channels"] == 2 and ring["bw_intra"] == 20.0
    assert "graph ring: 2 channels, 20/20 GB/s per channel (intra/inter), paths NVL intra" in (
        nccl_log.format_report(rep)
    )


def test_named_tuning_lines_give_algorithm_protocol_and_channels_per_call():
    rep = _parse("tuning_named.log")
    chosen = [
        (c["func"], c["nbytes"], c["algo"], c["proto"], c["channels"])
        for c in rep.calls
        if c["algo"]
    ]
    assert chosen == [
        ("AllReduce", 4096, "RING", "LL", "0..0"),
        ("AllReduce", 67108864, "RING", "SIMPLE", "0..1"),
        ("AllGather", 524288, "RING", "LL128", "0..1"),
    ]
    assert {c["rank"] for c in rep.calls} == {0, 1}  # comm pointer -> rank, per process
    assert [c["dtype"] for c in rep.calls[-2:]] == ["bfloat16", "bfloat16"]


def test_numbered_tuning_lines_of_older_nccl_and_forced_algorithm():
    rep = _parse("tuning_numbered.log")
    assert rep.version == "2.21.5+cuda12.4" and rep.env == {"NCCL_ALGO": "Tree"}
    chosen = {(c["rank"], c["op_count"]): (c["algo"], c["proto"]) for c in rep.calls}
    # only rank 0 prints TUNING lines: rank 1 ran the same algorithm, but its log does not say so
    assert chosen == {
        (0, 0): ("TREE", "LL"),
        (1, 0): (None, None),
        (0, 1): ("TREE", "SIMPLE"),
        (1, 1): (None, None),
    }
    assert rep.calls[-1]["nbytes"] == 67108864 * 8  # datatype 8 = float64


def test_multi_node_log_report():
    rep = _parse("multinode.log")
    assert {r["host"] for r in rep.ranks.values()} == {"gpu-node-a", "gpu-node-b"}
    assert rep.transports[(0, 1)] == {"P2P/CUMEM"} and rep.transports[(1, 2)] == {"NET/IB"}
    assert rep.trees[0][2] == ([3], 0) and rep.trees[1][2] == ([3, 0], -1)  # the 2 trees
    text = nccl_log.format_report(rep)
    assert "ranks: 4 on 2 host(s)" in text
    assert "transports (6 peer pairs): NET/IB, P2P/CUMEM" in text
    assert "4096 B float32 sum on 4 ranks -> algo TREE proto LL channels 0..1" in text
    assert "67108864 B float32 sum on 4 ranks -> algo RING proto SIMPLE" in text
    assert "HANG" not in text


def test_hang_names_the_rank_that_never_reached_the_collective():
    rep = _parse("hang.log")
    assert nccl_log.last_calls(rep)["0x7a6b5c4d3e2f1a0b"] == {0: 0x2B, 1: 0x2B, 2: 0x2B, 3: 0x2A}
    text = nccl_log.format_report(rep)
    assert "rank(s) [3] never reached opCount 2b" in text
    # both real WARN forms: "file.cc:LINE NCCL WARN" and "[time] ... file.cc:LINE (func) NCCL WARN"
    assert "WARN gpu-node-b [1] NET/IB : Got completion from peer" in text
    assert "WARN gpu-node-b [1] Cuda failure 'unspecified launch failure'" in text
    assert len(rep.warnings) == 2
    assert "not stated (add TUNING" in text


@pytest.mark.parametrize("name", sorted(os.listdir(LOGS)))
def test_every_fixture_says_it_is_hand_written(name):
    with open(os.path.join(LOGS, name)) as f:
        assert f.readline().startswith("# Hand-written fixture in NCCL")
