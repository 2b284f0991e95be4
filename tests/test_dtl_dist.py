"""dtl.dist: the grid's rank order (Megatron's, TP innermost), its groups, a plain-process init."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dtl import dist as dtl_dist
from dtl.dist import BackendError, choose_backend
from dtl.grid import ParallelGrid
from dtl.testing import run_distributed


def test_grid_puts_tp_innermost_then_cp_dp_pp_like_megatron():
    grid = ParallelGrid(dp=2, pp=2, cp=1, tp=2, world_size=8, rank=5)
    assert grid.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.group_ranks("cp") == [[r] for r in range(8)]
    assert (grid.dp_rank, grid.pp_rank, grid.cp_rank, grid.tp_rank) == (0, 1, 0, 1)
    assert grid.ranks_along("pp") == [1, 5] and grid.tp_size == 2
    assert str(grid) == "TP(2)-CP(1)-DP(2)-PP(2) rank 5: pp=1, dp=0, cp=0, tp=1"


def test_grid_reproduces_megatrons_16_gpu_example():
    # megatron/core/parallel_state.py, initialize_model_parallel docstring: tp=2, pp=4 on 16 GPUs
    grid = ParallelGrid(dp=2, pp=4, tp=2, world_size=16, rank=0)
    assert grid.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert grid.group_ranks("dp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert grid.group_ranks("pp")[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]


def test_combined_groups_follow_the_same_order_whatever_order_the_axes_are_named_in():
    grid = ParallelGrid(dp=2, pp=2, cp=2, tp=1, world_size=8, rank=3)  # view(pp, dp, cp, tp)
    assert grid.group_ranks("dp", "cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.group_ranks("cp", "dp") == grid.group_ranks("dp", "cp")
    assert grid.group_ranks("tp", "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.ranks_along("pp", "dp", "cp", "tp") == list(range(8))
    # TP2 x PP2 x DP2: Megatron's model-parallel group (tp x pp) for rank 5 = (pp 1, dp 0, tp 1)
    grid = ParallelGrid(dp=2, pp=2, tp=2, world_size=8, rank=5)
    assert grid.ranks_along("tp", "pp") == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="bad axes"):
        grid.group_ranks("tp", "tp")


def test_pipeline_neighbours_stages_and_embedding_ranks():
    # pp=4, dp=2: pp groups [0,2,4,6] [1,3,5,7]
    stages = [ParallelGrid(dp=2, pp=4, world_size=8, rank=r) for r in (0, 2, 6)]
    assert [(g.is_first_stage, g.is_last_stage) for g in stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert [(g.prev_rank, g.next_rank) for g in stages] == [(6, 2), (0, 4), (4, 0)]
    assert stages[1].embedding_ranks() == [0, 6]
    assert ParallelGrid(dp=2, world_size=2, rank=1).embedding_ranks() == [1]  # pp = 1


def test_a_fifth_axis_is_one_declaration_and_every_table_follows_it():
    # "ep" between dp and cp: the rank table is view(pp, dp, ep, cp, tp) = (1, 2, 2, 1, 2)
    axes = ("pp", "dp", "ep", "cp", "tp")
    grid = ParallelGrid(dp=2, tp=2, ep=2, axes=axes, world_size=8, rank=5)
    assert grid.ranks.shape == (1, 2, 2, 1, 2) and grid.ranks[0, 1, 0, 0, 1] == 5
    assert grid.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.group_ranks("ep", "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.ranks_along("tp", "ep") == [4, 5, 6, 7]
    assert (grid.dp_rank, grid.ep_rank, grid.tp_rank, grid.ep_size) == (1, 0, 1, 2)
    assert grid.group_size("ep", "tp") == 4 and ("dp", "cp") in grid.combos
    assert str(grid) == "TP(2)-CP(1)-EP(2)-DP(2)-PP(1) rank 5: pp=0, dp=1, ep=0, cp=0, tp=1"
    with pytest.raises(ValueError, match=r"ep given a size but not among the axes"):
        ParallelGrid(dp=2, ep=2, world_size=4, rank=0)  # the default axes have no "ep"
    with pytest.raises(ValueError, match=r"dp\*pp\*cp\*tp\*ep = 2\*1\*1\*1\*2 = 4 does not"):
        ParallelGrid(dp=2, ep=2, axes=axes, world_size=8, rank=0)


def test_grid_sizes_are_keyword_only():
    with pytest.raises(TypeError):
        ParallelGrid(2, 1, 1, 2)  # dp, pp, cp, tp: too easy to get in the wrong order


def test_grid_coordinates_are_a_bijection_for_every_rank():
    seen = set()
    for rank in range(24):
        g = ParallelGrid(dp=2, pp=3, cp=2, tp=2, world_size=24, rank=rank)
        coords = (g.pp_rank, g.dp_rank, g.cp_rank, g.tp_rank)  # the grid's (outer..inner) order
        assert g.ranks[coords].item() == rank
        seen.add(coords)
    assert len(seen) == 24


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(dp=2, tp=3), r"dp\*pp\*cp\*tp = 2\*1\*1\*3 = 6 does not match world size 4"),
        (dict(dp=0, tp=4), "dp must be a positive integer, got 0"),
        (dict(dp=2, tp=2.0), "tp must be a positive integer, got 2.0"),
    ],
)
def test_grid_that_does_not_fit_the_world_is_a_one_line_error(sizes, message):
    with pytest.raises(ValueError, match=message) as err:
        ParallelGrid(**sizes, world_size=4, rank=0)
    assert "\n" not in str(err.value)


def _sum_over_each_axis():
    grid = ParallelGrid(dp=2, tp=2)  # 4 ranks: tp groups [0,1] [2,3]; dp groups [0,2] [1,3]
    out = {}
    for axis in ("tp", "dp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=grid.group(axis))
        out[axis] = t.item()
    return out


def test_grid_groups_reduce_over_exactly_their_ranks():
    results = run_distributed(_sum_over_each_axis, world_size=4)
    assert [r["tp"] for r in results] == [1.0, 1.0, 5.0, 5.0]  # 0+1, 0+1, 2+3, 2+3
    assert [r["dp"] for r in results] == [2.0, 4.0, 2.0, 4.0]  # 0+2, 1+3, ...


def _combined_groups_mesh_and_embedding():
    from torch.distributed.device_mesh import DeviceMesh

    grid = ParallelGrid(pp=2, tp=2)  # 4 ranks: tp [0,1] [2,3]; pp [0,2] [1,3]
    out = {}
    for axes in (("tp", "pp"), ("dp", "cp")):
        t = torch.tensor([float(2 ** dist.get_rank())])  # a bit per rank: the sum names them
        dist.all_reduce(t, group=grid.group(*axes))
        out[axes] = int(t.item())
    t = torch.tensor([float(2 ** dist.get_rank())])
    dist.all_reduce(t, group=grid.embedding_group)
    out["embedding"] = int(t.item())
    mesh = grid.device_mesh()
    assert isinstance(mesh, DeviceMesh)
    out["mesh"] = {
        axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in ("pp", "dp", "tp")
    }
    out["grid"] = {axis: grid.ranks_along(axis) for axis in ("pp", "dp", "tp")}
    try:
        grid.group("tp", "cp")
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_combined_groups_embedding_group_and_device_mesh_match_the_grid():
    results = run_distributed(_combined_groups_mesh_and_embedding, world_size=4)
    assert [r[("tp", "pp")] for r in results] == [15] * 4  # all four ranks: 1+2+4+8
    assert [r[("dp", "cp")] for r in results] == [1, 2, 4, 8]  # dp = cp = 1: each rank alone
    assert [r["embedding"] for r in results] == [5, 10, 5, 10]  # {0, 2} and {1, 3}: pp ends
    for r in results:
        assert r["mesh"] == r["grid"]
        assert r["error"] == (
            "ParallelGrid: the cpxtp group was not built; pass combos=[('cp', 'tp')] "
            "to ParallelGrid(...)"
        )


def test_init_works_as_a_plain_one_process_run():
    code = (
        "from dtl import dist as d; import torch, torch.distributed as td; i = d.init(); "
        "t = torch.ones(2); td.all_reduce(t); "
        "print(i.rank, i.world_size, i.backend, i.device, t.tolist()); d.cleanup()"
    )
    env = {**os.environ, "DTL_BACKEND": "gloo"}  # the expected line says gloo, GPUs or not
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 1 gloo cpu [1.0, 1.0]"


def test_finish_cleans_up_then_exits_1_when_the_runs_checks_failed():
    # the passing side, finish(True), ends every lesson line tests/test_lessons.py runs
    code = (
        "import atexit, torch.distributed as td; from dtl import dist as d; d.init(); "
        "atexit.register(lambda: print('group left:', td.is_initialized())); d.finish(False)"
    )
    env = {**os.environ, "DTL_BACKEND": "gloo"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 1 and out.stdout.strip() == "group left: False", out.stderr


def test_backend_is_gloo_without_gpus_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("DTL_BACKEND", raising=False)
    if not torch.cuda.is_available():
        assert choose_backend(local_world_size=2) == "gloo"
    monkeypatch.setenv("DTL_BACKEND", "nccl")
    assert choose_backend(local_world_size=2) == "nccl"
    monkeypatch.setenv("DTL_BACKEND", "glo")
    with pytest.raises(BackendError, match="DTL_BACKEND='glo' is not a backend") as err:
        choose_backend(local_world_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "backend, message",
    [
        (
            "glo",
            "error: DTL_BACKEND='glo' is not a backend this course runs; use one of gloo, "
            "nccl (or unset it for the automatic choice)",
        ),
        ("nccl", "error: backend nccl needs CUDA GPUs; this machine has none (use gloo)"),
    ],
)
def test_a_bad_or_impossible_backend_is_a_one_line_error_before_any_group(backend, message):
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    code = "from dtl import dist as d; d.init(); print('initialized')"
    env = {**os.environ, "DTL_BACKEND": backend}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == message


@pytest.mark.skipif(os.environ.get("DTL_SOAK") != "1", reason="soak test: set DTL_SOAK=1 (~90 s)")
def test_cleanup_means_no_abort_at_exit_in_30_consecutive_2_rank_ddp_runs():
    worker = os.path.join(os.path.dirname(__file__), "ddp_exit_worker.py")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for attempt in range(30):
        proc = subprocess.run(
            [torchrun, "--standalone", "--nproc_per_node=2", worker],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"run {attempt}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert "terminate called" not in proc.stderr, f"run {attempt} aborted at exit"


def test_torchrun_restart_forms_a_fresh_group_after_a_crash():
    """--max-restarts=1: rank 1 crashes on attempt 0; both ranks must finish on attempt 1.
    Without the per-attempt store prefix in init(), 3 of 8 such runs failed here."""
    worker = os.path.join(os.path.dirname(__file__), "restart_worker.py")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for _ in range(2):
        proc = subprocess.run(
            [torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=1", worker],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "DTL_TIMEOUT_S": "30"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("attempt 1: all_reduce -> 2, ok") == 2, proc.stdout


def test_planned_backend_reads_each_launchers_local_size(monkeypatch):
    # the backend init() will pick, before it runs: NCCL only when every local rank has a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for name in ("DTL_BACKEND", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_SIZE", "8")  # the deepspeed launcher, 2 nodes of 8
    assert dtl_dist.local_world_size() == 8 and dtl_dist.planned_backend() == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # torchrun's name wins: 16 ranks, 8 GPUs
    assert dtl_dist.planned_backend() == "gloo"
    monkeypatch.setenv("DTL_BACKEND", "mpi")
    with pytest.raises(dtl_dist.BackendError, match="DTL_BACKEND='mpi'"):
        dtl_dist.planned_backend()


def _average_mixed_dtypes():
    rank = dist.get_rank()
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    unused = torch.nn.Parameter(torch.zeros(4))  # no gradient: skipped, not averaged as zeros
    a.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    b.grad = torch.tensor([10.0, 20.0], dtype=torch.float64) * (rank + 1)
    sent = dtl_dist.average_gradients([a, unused, b])
    return a.grad.tolist(), b.grad.tolist(), b.grad.dtype, unused.grad, sent


def test_average_gradients_is_the_mean_over_ranks_per_dtype_and_reports_its_bytes():
    for got_a, got_b, dtype, unused, sent in run_distributed(_average_mixed_dtypes, world_size=3):
        assert got_a == [2.0, 4.0, 6.0]  # (1 + 2 + 3) / 3 times the rank-1 gradient
        assert got_b == [20.0, 40.0] and dtype == torch.float64  # its own buffer, not cast
        assert unused is None
        assert sent == 3 * 4 + 2 * 8  # one fp32 buffer, one fp64 buffer


def test_matches_formula_is_equality_up_to_float_rounding_only():
    from dtl.metrics import matches_formula

    assert matches_formula(43_492_352.0, 43_492_352)
    assert matches_formula(0.1 + 0.2, 0.3)  # rounding
    assert not matches_formula(43_492_353, 43_492_352)  # one byte off is a mismatch
    assert not matches_formula(1.0, 0.0)  # a zero formula allows rounding, not a byte
    assert matches_formula(0.0, 0.0)
