"""The preflight's rules, one node at a time and all together (no processes, no network)."""

import socket

import pytest

from dtl.preflight import __main__ as preflight
from dtl.preflight import checks, exchange, network


@pytest.mark.parametrize(
    "rule, name, matches",
    [
        ("eth", "eth0", True),  # a prefix
        ("eth", "ens5", False),
        ("=eth0", "eth0", True),  # exact
        ("=eth", "eth0", False),
        ("^lo,docker", "eth0", True),  # exclusions
        ("^lo,docker", "docker0", False),
        ("^lo", "lo", False),
    ],
)
def test_nccl_socket_ifname_follows_nccls_three_forms(rule, name, matches):
    assert network.nccl_matches(rule, name) is matches


def test_gloo_interface_names_are_checked_in_gloos_own_syntax(monkeypatch):
    monkeypatch.setattr(network, "interfaces", lambda: {"lo": "127.0.0.1", "eth0": "10.0.0.5"})
    assert checks.interface_problems({"GLOO_SOCKET_IFNAME": "eth0"}) == []
    (exclusion,) = checks.interface_problems({"GLOO_SOCKET_IFNAME": "^lo"})
    assert "gloo takes interface names, not NCCL's ^ syntax; name one of eth0, lo" in exclusion
    (missing,) = checks.interface_problems({"GLOO_SOCKET_IFNAME": "eth9"})
    assert "no interface eth9" in missing
    assert checks.interface_problems({"NCCL_SOCKET_IFNAME": "^lo"}) == []
    (nccl,) = checks.interface_problems({"NCCL_SOCKET_IFNAME": "ib"})
    assert "NCCL_SOCKET_IFNAME=ib matches no interface" in nccl


def test_a_loopback_endpoint_is_named_on_every_node_but_the_one_it_names(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    worker = checks.Launch("localhost", 29500, nnodes=2, node_rank=1)
    (line,) = checks.endpoint_problems(worker)
    assert "localhost (the endpoint) is 127.0.0.1 on node1, this node's loopback" in line
    assert checks.endpoint_problems(checks.Launch("localhost", 29500, nnodes=1)) == []
    assert checks.endpoint_problems(checks.Launch("localhost", 29500, 2, node_rank=0)) == []
    (unknown,) = checks.endpoint_problems(checks.Launch("no-such-host.invalid", 1, 2))
    assert "does not resolve on node1" in unknown


def test_a_hostname_at_127_0_1_1_is_named_unless_gloo_is_told_its_interface(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(network, "interfaces", lambda: {"lo": "127.0.0.1", "eth0": "10.0.0.5"})
    monkeypatch.setattr(network, "resolve", lambda host: [])
    (unresolved,) = checks.gloo_problems({"GLOO_SOCKET_IFNAME": "eth0"})
    assert unresolved.startswith("hostname node1 does not resolve on this node")
    monkeypatch.setattr(network, "resolve", lambda host: ["127.0.1.1"])  # Debian's hosts file
    assert network.gloo_address(None) == "127.0.1.1"  # loopback, and bindable: gloo takes it
    (line,) = checks.gloo_problems({})
    assert "resolves to 127.0.1.1: gloo would bind it" in line
    assert checks.gloo_problems({"GLOO_SOCKET_IFNAME": "eth0"}) == []
    monkeypatch.setattr(network, "resolve", lambda host: ["10.0.0.5"])
    assert network.gloo_address(None) == "10.0.0.5"
    assert checks.gloo_problems({}) == []
    monkeypatch.setattr(network, "resolve", lambda host: ["10.9.9.9"])  # not this node's
    assert "gloo falls back to loopback" in checks.gloo_problems({})[0]


def _node(name, rank=None, torch="2.13.0", course="0.1.0+abc", markers=None):
    return exchange.NodeFacts(name, rank, torch, course, None, None, markers or {})


def test_nodes_together_name_a_shared_rank_a_shared_hostname_and_versions_that_differ():
    assert exchange.together_problems([_node("a", 0), _node("b", 1)]) == []
    (rank,) = exchange.together_problems([_node("a", 0), _node("b", 0)])
    assert rank.startswith("--node_rank=0 is given to 2 nodes")
    (name,) = exchange.together_problems([_node("a"), _node("a")])
    assert name.startswith("hostname a is on 2 nodes")
    (torch,) = exchange.together_problems([_node("a"), _node("b", torch="2.11.0")])
    assert torch == "torch differs between nodes: a 2.13.0, b 2.11.0"


def test_a_folder_is_shared_when_each_node_sees_the_others_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "a")
    folder = str(tmp_path)
    mine: dict[str, str] = {}
    exchange.write_markers((folder,), mine)
    theirs = {folder: str(tmp_path / ".dtl-preflight-b-1")}
    seen = [_node("a", markers=mine), _node("b", markers=theirs)]
    (unshared,) = exchange.folder_problems(seen, me=0)
    assert unshared.startswith(f"folder {folder} is not shared: a cannot see what b wrote")
    (tmp_path / ".dtl-preflight-b-1").write_text("b")
    assert exchange.folder_problems(seen, me=0) == []
    exchange.remove_markers(mine)
    assert [p.name for p in tmp_path.iterdir()] == [".dtl-preflight-b-1"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--endpoint=node0"], "error: --endpoint=node0: expected host:port (or set MASTER_ADDR)"),
        (
            ["--endpoint=node0:1", "--nnodes=1:2"],
            "error: --nnodes=1:2: a number of nodes from 1 (elastic MIN:MAX: give MAX)",
        ),
    ],
)
def test_a_bad_launch_description_is_refused_in_one_line(argv, line, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # a node's preflight speaks whatever rank its job says
    with pytest.raises(SystemExit) as stop:
        preflight.main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == line


def test_one_node_passes_alone_and_says_what_it_checked(tmp_path, capsys):
    assert preflight.main(["--endpoint=localhost:0", "--timeout=5", f"--folders={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "ok, 1 of 1 nodes met at localhost:0 = 127.0.0.1" in out
    assert list(tmp_path.iterdir()) == []  # its marker removed
