"""Day 16: the benchmark and the forensics script: bad input fails in one line before any
collective, every op's correctness check passes (and can fail), busbw uses nccl-tests' factors,
the step/byte counts match, Ctrl-C prints the partial table, the CPU forensics path works."""

import os
import pickle
import re
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from day16_nccl import (
    algorithms,
    bench,
    cost_model,
    flight_recorder,
    forensics,
    nccl_log,
    ops,
    report,
)
from dtl import config as dtl_config
from dtl import registry
from dtl.script_server import run_script
from dtl.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_bytes=1"], "min_bytes > max_bytes"),
        (["--factor=1"], "factor"),
        (["--ops=all_reduce,nope"], "unknown op(s) ['nope']"),
        (["--dtype=float8"], "dtype 'float8'"),
        (["--nccl_algo=Rnig"], "nccl_algo: 'Rnig'"),
        (["--nccl_proto=LL256"], "nccl_proto: 'LL256'"),
        (["--bogus=1"], "unknown config key 'bogus'"),
    ],
)
def test_bench_rejects_bad_input(argv, message):
    with pytest.raises(
        dtl_config.ConfigError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        dtl_config.load(bench.Config, argv)


def test_nccl_knobs_accept_what_nccl_accepts():
    cfg = dtl_config.load(bench.Config, ["--nccl_algo=^Tree,ring", "--nccl_proto=Simple"])
    assert cfg.nccl_algo == "^Tree,ring"
    dtl_config.load(bench.Config, ["--nccl_algo=allreduce:tree;broadcast:ring"])
    dtl_config.load(bench.Config, ["--nccl_algo=allreduce:^tree"])  # per-function exclusion


def test_forensics_rejects_bad_input(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (
        ["--sizes=2"],
        ["--sizes=a,b"],
        ["--fixture=missing.log"],
        ["--hang_rank=2"],  # no such rank in a world of 2
        ["--hang_rank=-3"],
        ["--hang_rank=1", "--hang_timeout_s=0"],
    ):
        with pytest.raises(dtl_config.ConfigError):
            dtl_config.load(forensics.Config, argv)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(dtl_config.ConfigError, match="world of >= 2"):
        dtl_config.load(forensics.Config, ["--hang_rank=0"])  # nobody left to wait


def _fr_entry(seq, name, sizes, state="completed", group=("0", "default_pg")):
    return {"collective_seq_id": seq, "profiling_name": name, "state": state,
            "input_sizes": sizes, "process_group": list(group)}  # fmt: skip


def _write_dump(tmp_path, rank, entries):
    path = str(tmp_path / f"fr_trace_rank_{rank}")  # torch's layout: a pickle per rank
    with open(path, "wb") as f:
        pickle.dump({"version": "2.10", "pg_config": {}, "entries": entries}, f)
    return path


def test_flight_recorder_report_names_the_rank_behind(tmp_path):
    done = [_fr_entry(s, "gloo:all_reduce", [[1024]]) for s in (1, 2)]
    stuck = _fr_entry(3, "gloo:all_reduce", [[16777216]], state="scheduled")
    other = ("1", "tp_group")  # a second group where all ranks agree: not a finding
    agree = [_fr_entry(1, "gloo:broadcast", [[8]], group=other)]
    paths = [
        _write_dump(tmp_path, 0, done + [stuck] + agree),
        _write_dump(tmp_path, 1, done + agree),  # rank 1 never entered #3
        _write_dump(tmp_path, 2, done + [stuck] + agree),
    ]
    (finding,) = flight_recorder.report(paths)
    assert finding.group == "0/default_pg" and finding.behind == [1] and finding.top == 3
    assert finding.last == {0: 3, 1: 2, 2: 3}
    assert "16777216" in finding.waiting_in and "scheduled" in finding.waiting_in
    assert "rank(s) [1] fell behind" in finding.line() and "#2 gloo:all_reduce" in finding.line()
    same = [_write_dump(tmp_path, r, done) for r in range(2)]
    assert flight_recorder.report(same) == []  # every rank at the same place: no suspect
    with pytest.raises(ValueError, match="<prefix><rank>"):
        flight_recorder.load(str(tmp_path / "no_rank_here"))


def test_bad_size_is_one_line_on_stderr_before_any_process_group():
    proc = run_script("day16_nccl.bench", "--min_bytes=0", cwd=ROOT, timeout_s=60)
    assert proc.code == 2 and not proc.group
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: bad sizes")


def _bench_every_op():
    cfg = dtl_config.load(
        bench.Config,
        ["--reps=1", "--iters=1", "--max_bytes=65536", "--min_bytes=65536", "--chunk_kib=16"],
    )
    rows = [
        bench.measure(cfg, op, nbytes, torch.device("cpu"))
        for op in ops.OPS
        for nbytes in (4096 + 12, 65536)
    ]  # 4108 B: not divisible by 3
    counts_ok = bench.count_check(cfg, torch.device("cpu"))
    real = algorithms.ring_all_reduce  # negative control: a ring that does nothing
    try:
        algorithms.ring_all_reduce = lambda t, group=None: algorithms.Stats()
        case = ops.make_case(
            "ring_all_reduce", 4096, dist.get_world_size(), torch.float32, torch.device("cpu"), 2048
        )
        broken = case.check()
    finally:
        algorithms.ring_all_reduce = real
    return rows, counts_ok, broken


# nccl-tests' doc/PERFORMANCE.md at n = 3, written out: all-reduce 2(n-1)/n = 4/3, all-gather and
# reduce-scatter (n-1)/n = 2/3, broadcast 1
FACTOR_AT_3 = {
    "all_reduce": 4 / 3,
    "all_gather": 2 / 3,
    "reduce_scatter": 2 / 3,
    "broadcast": 1.0,
    "ring_all_reduce": 4 / 3,
    "tree_all_reduce": 4 / 3,
    "dbt_all_reduce": 4 / 3,
    "ring_reduce_scatter": 2 / 3,
    "ring_all_gather": 2 / 3,
}


def test_every_op_passes_its_check_and_busbw_uses_the_nccl_tests_factor():
    rows, counts_ok, broken = run_distributed(_bench_every_op, world_size=3)[0]
    assert {r["op"] for r in rows} == set(ops.OPS) == set(FACTOR_AT_3)
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["busbw"] == pytest.approx(r["algbw"] * FACTOR_AT_3[r["op"]])
        # algbw = S / t in GB/s, from the row's own bytes and median time
        assert r["algbw"] == pytest.approx(r["nbytes"] / r["time_us"] / 1e3)
    assert counts_ok
    assert broken > 0, "the correctness check did not notice a broken all-reduce"


def test_report_tables_and_model_on_synthetic_rows(tmp_path):
    alpha, beta, n = 100e-6, 1e9, 4
    rows = []
    for op, name in report.MODEL_ALGOS.items():
        for s in (2**20, 2**22, 16 * 2**20, 64 * 2**20):
            t = cost_model.predict(alpha, beta, name, s, n, 4, 2**21, 2)
            rows.append(
                dict(
                    op=op,
                    nbytes=s,
                    count=s // 4,
                    dtype="float32",
                    n=n,
                    time_us=t * 1e6,
                    min_us=t * 1e6,
                    p25_us=t * 1e6,
                    spread=1.0,
                    algbw=s / t / 1e9,
                    busbw=s / t / 1e9 * 1.5,
                    wrong=0,
                )
            )
    rows += [dict(r, op="all_reduce", busbw=r["busbw"] / 2) for r in rows[:4]]
    cfg = dtl_config.load(bench.Config, [f"--out_dir={tmp_path}"])
    assert report.ring_ratio(rows) == {
        16 * 2**20: pytest.approx(2.0),
        64 * 2**20: pytest.approx(2.0),
    }
    assert "ring_all_reduce" in report.busbw_table(rows)
    lines, model = report.model_report(rows, cfg, cores=2)
    assert model["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert all(max(e) < 1e-6 for e in model["errors"].values())
    text = "\n".join(lines)
    assert "fitted on 12 25th-percentile times" in text
    k_line = next(x for x in lines if x.startswith("  tree: k* = sqrt"))
    k_star = cost_model.k_star(alpha, beta, "tree", 64 * 2**20, n)
    assert f"= {k_star:.1f} (D = 2, links)" in k_line and "2 CPU cores view's best k = 1" in k_line
    # the CPU view prints crossovers for the measured n only, labelled as a model
    assert [x for x in lines if "beats ring at n = " in x] == [
        x for x in lines if "beats ring at n = 4 " in x and x.startswith("model (2-core view")
    ] and len([x for x in lines if "beats ring" in x]) == 2
    gpu_lines, _ = report.model_report(rows, cfg, cores=None)
    assert any("links view" in x and "at n = 512 " in x for x in gpu_lines)
    assert os.path.isfile(tmp_path / "cost_model.png")


def _forensics_gloo():
    cfg = dtl_config.load(forensics.Config, ["--sizes=4096,1048576"])
    return forensics.run_all_reduces(cfg.byte_sizes(), torch.device("cpu"))


def test_forensics_gloo_path_and_fixture_digest():
    assert run_distributed(_forensics_gloo, world_size=2) == [True, True]
    rep = nccl_log.parse_files([os.path.join(forensics.FIXTURES, "multinode.log")])
    assert forensics.report_lines(rep) == (
        "NCCL 2.26.2+cuda12.2, 4 ranks on 2 host(s), transports NET/IB, P2P/CUMEM, 2 channels, "
        "all-reduce 4096 B -> TREE/LL; 67108864 B -> RING/SIMPLE"
    )


def test_ctrl_c_prints_the_rows_measured_so_far(tmp_path):
    proc = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "day16_nccl.bench",
            "--full",
            f"--out_dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    seen = []
    try:
        for line in proc.stdout:
            seen += [line] if line.startswith("all_reduce ") else []
            if len(seen) == 3:  # three rows in: press Ctrl-C (SIGINT to the whole group)
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "interrupted: " in rest, rest[-2000:]
    with open(tmp_path / "bench_partial.csv") as f:
        assert len(f.read().splitlines()) >= 1 + 3  # header + the rows printed before Ctrl-C


def test_times_that_do_not_grow_with_size_fit_beta_inf_and_say_why(tmp_path, capsys):
    # what a smoke run on a noisy box can measure: 4 MiB no slower than 1 MiB
    rows = [
        dict(op=op, nbytes=s, count=s // 4, dtype="float32", n=2, time_us=2000.0, min_us=2000.0,
             p25_us=2000.0, spread=1.0, algbw=s / 2e-3 / 1e9, busbw=s / 2e-3 / 1e9, wrong=0)
        for op in report.MODEL_ALGOS
        for s in (2**20, 2**22)
    ]  # fmt: skip
    cfg = dtl_config.load(bench.Config, [f"--out_dir={tmp_path}"])
    lines, model = report.model_report(rows, cfg, cores=2)
    assert model["beta"] == float("inf") and model["alpha"] > 0
    assert any(line.startswith("beta = inf: the times did not grow") for line in lines)
    report.write(cfg, rows, final=True, cores=2)
    out = capsys.readouterr().out
    run = next(r for x in registry.load() if x.day == 16 for r in x.runs if r.name == "bench")
    pattern = next(p for p in run.expect if "cost model" in p)
    assert re.search(pattern, out, re.M), "the launch line's expect must accept beta = inf"


def test_one_rank_prints_busbw_and_the_ring_ratio_as_na_and_fits_no_model(tmp_path, capsys):
    # world size 1 (a 1-GPU machine): busbw has factor 0 (2(n-1)/n), the ring/built-in ratio was
    # 0/0 (ZeroDivisionError) and the model has no rounds to fit; all three say so instead
    cfg = dtl_config.load(bench.Config, [f"--out_dir={tmp_path}"])
    rows = [
        dict(op=op, nbytes=s, count=s // 4, dtype="float32", n=1, time_us=50.0, min_us=45.0,
             p25_us=48.0, spread=1.1, algbw=s / 50e-6 / 1e9, busbw=None, wrong=0)
        for op in ("ring_all_reduce", "tree_all_reduce", "all_reduce")
        for s in (16 * 2**20, 64 * 2**20)
    ]  # fmt: skip
    assert report.ring_ratio(rows) == {16 * 2**20: None, 64 * 2**20: None}
    assert report.busbw_table(rows) == f"busbw (GB/s): {report.NO_LINK}"
    assert report.format_row(rows[0]).split()[6] == "n/a"
    lines, model = report.model_report(rows, cfg, cores=2)
    assert model is None and lines[0].startswith("cost model: not fitted: on 1 rank")
    report.write(cfg, rows, final=True, cores=2)
    out = capsys.readouterr().out
    assert "summary: bench 6 rows on 1 ranks, 0 wrong elements" in out
    assert f"all_reduce busbw at 64 MiB = {report.NO_LINK}" in out
    assert "summary: cost model not fitted" in out and "cost model alpha" not in out
    assert (tmp_path / "bench.csv").is_file() and (tmp_path / "busbw.png").is_file()
