"""Parse an NCCL_DEBUG=INFO log into a report: what NCCL built and what it chose.

    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,COLL NCCL_DEBUG_FILE=nccl.%h.%p.log ...
    python -m day16_nccl.nccl_log nccl.*.log

Every line NCCL writes starts `host:pid:tid [cudaDev] NCCL INFO ...` (src/debug.cc). The lines read:
    NCCL version 2.26.2+cuda12.2                                           version
    ncclCommInitRank comm 0x.. rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 18000 commId 0x.. -
        Init START / Init COMPLETE                                         rank -> host, device
    comm 0x.. rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0     nodes
    Channel 00/02 :    0   1   2   3                                      ring order, #channels
    Trees [0] 1/2/-1->0->-1 [1] 1/-1/-1->0->2                  children/../..->rank->parent
    Pattern 4, crossNic 0, nChannels 2, bw 20.000000/20.000000, type NVL/PIX, sameChannels 1
                                                   a searched graph: pattern, GB/s, path types
    Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA                 transport per peer
    2 coll channels, 2 collnet channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer
    AllReduce: opCount 3 sendbuff 0x.. recvbuff 0x.. count 1024 datatype 7 op 0 root 0 comm 0x..
        [nranks=4] stream 0x..                                             a collective call (COLL)
    AllReduce: 4096 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}     its choice (TUNING,
                                                                           NCCL >= ~2.23, rank 0)
    4096 Bytes -> Algo 0 proto 0 time 12.3                                 its choice (TUNING,
                                                                           NCCL 2.20-2.22, rank 0)
    NCCL_ALGO set by environment to Ring                                  a forced knob
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

# INFO:  host:pid:tid [dev] NCCL INFO msg
# WARN:  host:pid:tid [dev] file.cc:LINE NCCL WARN msg
#        (newer: "... file.cc:LINE (func) NCCL WARN"; with a timestamp, "[date time] " first)
# TRACE: host:pid:tid [dev] 12.345 func:LINE NCCL TRACE msg   (elapsed ms, then where)
PREFIX = re.compile(
    r"(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>-?\d+)\]"
    r"(?: [\d.]+)?(?: \S+:\d+(?: \([^)]*\))?)? NCCL "
    r"(?P<level>INFO|WARN|TRACE) (?P<msg>.*)$"
)
VERSION = re.compile(r"NCCL version (\S+)")
INIT = re.compile(
    r"comm (0x[0-9a-f]+) rank (\d+) nranks (\d+) cudaDev (\d+) nvmlDev \d+ "
    r"busId ([0-9a-f]+) .*commId (0x[0-9a-f]+) - Init (START|COMPLETE)"
)
NODES = re.compile(
    r"comm 0x[0-9a-f]+ rank (\d+) nRanks \d+ nNodes (\d+) localRanks (\d+) "
    r"localRank (\d+)"
)
RING = re.compile(r"^Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*$")
TREE = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)")
PEER = re.compile(
    r"^Channel (\d+)(?:/\d+)? : (\d+)\[[0-9a-f]+\] -> (\d+)\[[0-9a-f]+\]"
    r"(?: \[(send|receive)\])? via (.+?)\s*$"
)
NCHANNELS = re.compile(r"(\d+) coll channels,")
GRAPH = re.compile(
    r"^Pattern (\d+), crossNic (\d+), nChannels (\d+), bw ([\d.]+)/([\d.]+), "
    r"type (\w+)/(\w+), sameChannels (\d+)"
)
# src/graph/topo.h: NCCL_TOPO_PATTERN_*, the shape a graph search looked for
PATTERNS = {
    1: "balanced tree",
    2: "split tree",
    3: "tree",
    4: "ring",
    5: "nvls",
    6: "collnet direct",
}
ENV = re.compile(r"^(NCCL_\w+) set by environment to (.*)$")
CALL = re.compile(
    r"^(\w+): opCount ([0-9a-f]+) sendbuff \S+ recvbuff \S+ count (\d+) "
    r"datatype (\d+) op (\d+) root (\d+) comm (0x[0-9a-f]+) \[nranks=(\d+)\]"
)
TUNE_NAMED = re.compile(
    r"^(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+) "
    r"channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}"
)
TUNE_NUMBERED = re.compile(r"^(\d+) Bytes -> Algo (\d+) proto (\d+) time ([\d.]+)")

# src/include/nccl_common.h (algorithms, protocols) and nccl.h (ncclDataType_t, ncclRedOp_t)
ALGOS = ["TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"]
PROTOS = ["LL", "LL128", "SIMPLE"]
DTYPES = [
    ("int8", 1),
    ("uint8", 1),
    ("int32", 4),
    ("uint32", 4),
    ("int64", 8),
    ("uint64", 8),
    ("float16", 2),
    ("float32", 4),
    ("float64", 8),
    ("bfloat16", 2),
]
OPS = ["sum", "prod", "max", "min", "avg"]


@dataclass
class Report:
    version: str | None = None
    ranks: dict = field(default_factory=dict)  # rank -> {host, pid, dev, bus_id, node info}
    transports: dict = field(default_factory=lambda: defaultdict(set))  # (src, dst) -> {"P2P/IPC"}
    n_channels: int | None = None
    rings: dict = field(default_factory=dict)  # channel -> [rank order]
    trees: dict = field(default_factory=lambda: defaultdict(dict))  # channel -> rank -> (kids, up)
    calls: list = field(default_factory=list)  # dicts, in log order, every rank's
    env: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    comms: dict = field(default_factory=dict)  # (host, pid, comm pointer) -> (commId, rank)
    graphs: list = field(default_factory=list)  # one dict per Pattern line (rank 0's are enough)


def parse(lines) -> Report:
    rep = Report()
    pending: dict = defaultdict(list)  # (host, pid) -> calls still waiting for a TUNING line
    for raw in lines:
        m = PREFIX.search(raw)
        if not m:  # NCCL_DEBUG=VERSION prints a bare "NCCL version ..." line
            v = VERSION.search(raw)
            rep.version = rep.version or (v.group(1) if v else None)
            continue
        msg, proc = m["msg"], (m["host"], int(m["pid"]))
        if m["level"] == "WARN":
            rep.warnings.append(f"{m['host']} [{m['dev']}] {msg}")
        elif not _parse_init(rep, msg, m):
            _parse_graph(rep, msg) or _parse_coll(rep, msg, proc, pending[proc])
    return rep


def _parse_init(rep: Report, msg: str, m) -> bool:
    if (v := VERSION.match(msg)) is not None:
        rep.version = v.group(1)
    elif (i := INIT.search(msg)) is not None:
        rank = int(i.group(2))
        rep.ranks.setdefault(rank, {}).update(
            host=m["host"],
            pid=int(m["pid"]),
            dev=int(i.group(4)),
            bus_id=i.group(5),
            nranks=int(i.group(3)),
        )
        rep.comms[(m["host"], int(m["pid"]), i.group(1))] = (i.group(6), rank)
    elif (nd := NODES.search(msg)) is not None:
        rank, nodes, local_ranks, local_rank = map(int, nd.groups())
        rep.ranks.setdefault(rank, {}).update(nnodes=nodes, local_rank=local_rank)
    elif (e := ENV.match(msg)) is not None:
        rep.env[e.group(1)] = e.group(2).strip()
    else:
        return False
    return True


def _parse_graph(rep: Report, msg: str) -> bool:
    if (r := RING.match(msg)) is not None:
        rep.rings[int(r.group(1))] = [int(x) for x in r.group(3).split()]
        rep.n_channels = int(r.group(2))
    elif msg.startswith("Trees "):
        for ch, *kids_me_up in TREE.findall(msg):
            c0, c1, c2, me, up = map(int, kids_me_up)
            rep.trees[int(ch)][me] = ([k for k in (c0, c1, c2) if k != -1], up)
    elif (p := PEER.match(msg)) is not None:
        rep.transports[(int(p.group(2)), int(p.group(3)))].add(transport_class(p.group(5)))
    elif (g := GRAPH.match(msg)) is not None:
        pattern, cross, nch = (int(x) for x in g.group(1, 2, 3))
        graph = dict(
            pattern=PATTERNS.get(pattern, f"pattern {pattern}"),
            cross_nic=cross,
            channels=nch,
            bw_intra=float(g.group(4)),
            bw_inter=float(g.group(5)),
            path_intra=g.group(6),
            path_inter=g.group(7),
        )
        if graph not in rep.graphs:  # every rank prints the same search result
            rep.graphs.append(graph)
    elif (c := NCHANNELS.search(msg)) is not None:
        rep.n_channels = rep.n_channels or int(c.group(1))
    else:
        return False
    return True


def transport_class(via: str) -> str:
    """P2P/CUMEM/read -> P2P/CUMEM; NET/IB/0/GDRDMA -> NET/IB; SHM/direct/direct -> SHM."""
    parts = via.split("/")
    return parts[0] if parts[0] == "SHM" else "/".join(parts[:2])


def _parse_coll(rep: Report, msg: str, proc: tuple, pending: list) -> bool:
    if (c := CALL.match(msg)) is not None:
        func, op_count, count, dtype, op, root, comm, nranks = c.groups()
        name, size = DTYPES[int(dtype)] if int(dtype) < len(DTYPES) else (f"type{dtype}", 0)
        call = dict(
            func=func,
            op_count=int(op_count, 16),
            count=int(count),
            dtype=name,
            nbytes=int(count) * size,
            op=OPS[int(op)] if int(op) < len(OPS) else op,
            root=int(root),
            nranks=int(nranks),
            algo=None,
            proto=None,
            channels=None,
        )
        call["comm_id"], call["rank"] = rep.comms.get((*proc, comm), (comm, None))
        rep.calls.append(call)
        pending.append(call)
    elif (t := TUNE_NAMED.match(msg)) is not None:
        func, nbytes, algo, proto, lo, hi = t.groups()
        _attach(pending, func, int(nbytes), algo.upper(), proto.upper(), f"{lo}..{hi}")
    elif (t := TUNE_NUMBERED.match(msg)) is not None:
        nbytes, algo, proto, _ = t.groups()
        _attach(pending, None, int(nbytes), ALGOS[int(algo)], PROTOS[int(proto)], None)
    else:
        return False
    return True


def _attach(pending: list, func, nbytes: int, algo: str, proto: str, channels) -> None:
    """A TUNING line follows its call in the same process: the oldest pending call with that
    function and size gets it (AllGather/ReduceScatter count per rank: size x nranks matches)."""
    for i, call in enumerate(pending):
        if func in (None, call["func"]) and nbytes in (
            call["nbytes"],
            call["nbytes"] * call["nranks"],
        ):
            call.update(algo=algo, proto=proto, channels=channels)
            del pending[: i + 1]
            return


def last_calls(rep: Report) -> dict[str, dict[int, int]]:
    """Per communicator, the highest opCount seen per rank: unequal values = a rank behind."""
    by_comm: dict = defaultdict(dict)
    for call in rep.calls:
        seen = by_comm[call["comm_id"]]
        seen[call["rank"]] = max(seen.get(call["rank"], -1), call["op_count"])
    return dict(by_comm)


def behind(last: dict[int, int]) -> tuple[list[int], int] | None:
    """Given each rank's last sequence number on one communicator (an NCCL opCount, a Flight
    Recorder collective_seq_id), the ranks that never reached the highest one and that number;
    None when every rank is at the same place. A hang: they are the ranks the others wait for."""
    if len(set(last.values())) < 2:
        return None
    top = max(last.values())
    return sorted(r for r, seq in last.items() if seq < top), top


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def format_report(rep: Report) -> str:
    out = [f"NCCL version: {rep.version or 'not in log'}"]
    hosts = sorted({r.get("host", "?") for r in rep.ranks.values()})
    out.append(f"ranks: {len(rep.ranks)} on {len(hosts)} host(s)")
    for rank in sorted(rep.ranks):
        r = rep.ranks[rank]
        out.append(
            f"  rank {rank:>3} -> {r.get('host', '?')} cuda:{r.get('dev', '?')} "
            f"busId {r.get('bus_id', '?')} pid {r.get('pid', '?')}"
            + (f" local rank {r['local_rank']}" if "local_rank" in r else "")
        )
    out.append(f"transports ({len(rep.transports)} peer pairs): " + summarize_transports(rep))
    for (src, dst), kinds in sorted(rep.transports.items()):
        out.append(f"  {src} -> {dst}: {', '.join(sorted(kinds))}")
    out.append(f"channels: {rep.n_channels if rep.n_channels is not None else 'not in log'}")
    for ch, order in sorted(rep.rings.items()):
        out.append(f"  ring  {ch:>2}: {' -> '.join(map(str, order))} -> {order[0]}")
    for ch, nodes in sorted(rep.trees.items()):
        root = [me for me, (_, up) in nodes.items() if up == -1]
        edges = " ".join(f"{me}->{up}" for me, (_, up) in sorted(nodes.items()) if up != -1)
        out.append(f"  tree  {ch:>2}: root {root[0] if root else '?'}; child->parent {edges}")
    for g in rep.graphs:
        out.append(
            f"  graph {g['pattern']}: {g['channels']} channels, {g['bw_intra']:g}/"
            f"{g['bw_inter']:g} GB/s per channel (intra/inter), paths {g['path_intra']} intra, "
            f"{g['path_inter']} inter"
        )
    if rep.env:
        out.append("set by environment: " + ", ".join(f"{k}={v}" for k, v in rep.env.items()))
    out.append(f"collective calls: {len(rep.calls)} (all ranks)")
    tuned = [c["rank"] for c in rep.calls if c["algo"]]
    for c in rep.calls:
        if c["algo"] and c["rank"] == min(tuned, key=lambda r: -1 if r is None else r):
            # one rank's view (NCCL >= ~2.23 prints TUNING lines on rank 0 only)
            out.append(
                f"  {c['func']} opCount {c['op_count']:x} {c['nbytes']} B {c['dtype']} "
                f"{c['op']} on {c['nranks']} ranks -> algo {c['algo']} proto {c['proto']}"
                + (f" channels {c['channels']}" if c["channels"] else "")
            )
    if rep.calls and not any(c["algo"] for c in rep.calls):
        out.append("  algorithm/protocol: not stated (add TUNING to NCCL_DEBUG_SUBSYS)")
    for comm_id, last in last_calls(rep).items():
        late = behind(last)
        if late is None:
            continue
        seen = ", ".join(f"{r}: {op:x}" for r, op in sorted(last.items()))
        out.append(
            f"HANG SUSPECT (comm {comm_id}): last opCount per rank {{{seen}}}: "
            f"rank(s) {late[0]} never reached opCount {late[1]:x}"
        )
    out += [f"WARN {w}" for w in rep.warnings]
    return "\n".join(out)


def summarize_transports(rep: Report) -> str:
    kinds = sorted({k for ks in rep.transports.values() for k in ks})
    return ", ".join(kinds) if kinds else "not in log (add INIT to NCCL_DEBUG_SUBSYS)"


def parse_files(paths) -> Report:
    lines = []
    for path in paths:
        with open(path, errors="replace") as f:
            lines += f.read().splitlines()
    return parse(lines)


USAGE = """usage: python -m day16_nccl.nccl_log NCCL_LOG [NCCL_LOG ...]

Turn NCCL_DEBUG=INFO logs (one file per rank, or one for all) into a report: NCCL version, ranks to
hosts and devices, transports per pair, channels, rings and trees, each call's algorithm and
protocol, the last operation of every rank (hang suspects) and warnings."""


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    missing = [p for p in argv if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"error: NCCL log not found: {missing[0]}")
    print(format_report(parse_files(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
