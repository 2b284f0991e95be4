"""NCCL's rules checked on gloo (dtl/nccl_rules.py) and the torch 2.13 names (dtl/compat.py).

Each check is shown to fail on the bug it names: a tensor factory with no device (the shape of
a barrier's timings or a bucket layout built on the host and broadcast), a receive order that
only tags made right, a direct call of a collective torch 2.11 does not have.
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtl import compat, nccl_rules
from dtl.comm import CommCounter
from dtl.testing import run_distributed

# --- 1. tensors on the run's device: the static rule ------------------------------------------


def test_every_tensor_factory_names_its_device():
    found = nccl_rules.factories_without_device()
    assert not found, (
        "tensor factories with no device (NCCL would get a CPU tensor); pass device=, "
        "or mark the line '# host: <why>':\n" + "\n".join(found)
    )


# the two bugs the rule was written for, as they were (day 15 check_barrier, day 17 BucketDDP)
BUGGY = """
import torch, torch.distributed as dist

def check_barrier(n, arrived, left, group=None):
    times = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(times, torch.tensor([arrived, left], dtype=torch.float64), group=group)

def rebuild_buckets(self):
    order = torch.tensor(self.ready_order, dtype=torch.int64)
    dist.broadcast(order, src=0)
"""

FIXED = """
import torch, torch.distributed as dist

def check_barrier(n, arrived, left, device, group=None):
    times = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(n)]
    mine = torch.tensor([arrived, left]).to(device)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(3, generator=gen)  # host: a CPU generator, never in a collective
    dist.all_gather(times, mine, group=group)
"""


def test_the_rule_fails_on_the_bugs_it_names(tmp_path):
    buggy, fixed = tmp_path / "buggy.py", tmp_path / "fixed.py"
    buggy.write_text(BUGGY)
    fixed.write_text(FIXED)
    found = nccl_rules.factories_without_device([buggy])
    assert [line.split(":")[1] for line in found] == ["5", "6", "9"], found
    assert nccl_rules.factories_without_device([fixed]) == []


# --- 2. p2p matched in posting order, as NCCL does ---------------------------------------------


def _crossed_order():
    """Rank 0 sends a (tag 1) then b (tag 2); rank 1 receives tag 2 first. Gloo matches by tag
    and gets it right; NCCL matches in posting order and would hand b's buffer a."""
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if dist.get_rank() == 0:
        works = [dist.isend(a, dst=1, tag=1), dist.isend(b, dst=1, tag=2)]
        for w in works:
            w.wait()
        return None
    got_b, got_a = torch.empty(4), torch.empty(4)
    dist.irecv(got_b, src=0, tag=2).wait()
    dist.irecv(got_a, src=0, tag=1).wait()
    return got_a[0].item(), got_b[0].item()


def _crossed_order_batched():
    """The same through P2POp + batch_isend_irecv (days 15, 16 and 21 post their rings so)."""
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if dist.get_rank() == 0:
        ops = [dist.P2POp(dist.isend, a, 1, None, 1), dist.P2POp(dist.isend, b, 1, None, 2)]
    else:
        a, b = torch.empty(4), torch.empty(4)
        ops = [dist.P2POp(dist.irecv, b, 0, None, 2), dist.P2POp(dist.irecv, a, 0, None, 1)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return a[0].item(), b[0].item()


def _both_ways():
    """Each crossed order once as gloo matches (by tag) and once as NCCL does (posting order)."""
    out = {}
    for body in (_crossed_order, _crossed_order_batched):
        nccl_rules.restore_p2p_tags()
        with_tags = body()
        nccl_rules.ignore_p2p_tags()
        out[body.__name__] = (with_tags, body())
    return out


def test_ignoring_tags_exposes_an_order_only_tags_made_right():
    for name, (with_tags, as_nccl) in run_distributed(_both_ways, world_size=2)[1].items():
        assert with_tags == (1.0, 2.0), name  # gloo: matched by tag, the bug hides
        assert as_nccl == (2.0, 1.0), name  # posting order: the receives swap, as on a GPU


def test_the_suite_runs_with_tags_ignored():
    # tests/conftest.py sets it, so every multi-rank test and launch line matches as NCCL does
    assert os.environ.get(nccl_rules.IGNORE_TAGS_ENV) == "1"
    assert nccl_rules.tags_ignored()


# --- 3. collectives torch 2.11 does not have ---------------------------------------------------


def _hidden_then_new():
    """Under DTL_HIDE_NEW_COLLECTIVES compat takes the old names and CommCounter counts what it
    sent; then, with the hiding undone in this process, compat takes torch 2.13's names."""
    x = torch.arange(4.0) + dist.get_rank()
    full, shard = torch.empty(8), torch.empty(2)
    hidden = {"available": compat.available()}
    with CommCounter() as comm:
        compat.all_gather_single(full, x)
        compat.reduce_scatter_single(shard, x)
    hidden.update(full=full.tolist(), shard=shard.tolist(), bytes=dict(comm.bytes))
    for name in compat.NEW_TO_OLD:
        real = getattr(dist.distributed_c10d, name, None)
        if real is not None:
            setattr(dist, name, real)
    with CommCounter() as comm:
        compat.all_gather_single(full, x)
    return hidden, (compat.available(), dict(comm.calls))


def test_compat_falls_back_under_the_hiding_and_takes_the_new_names_otherwise():
    assert os.environ.get(compat.HIDE_ENV) == "1"  # the whole suite runs as torch 2.11 would
    hidden, (available, calls) = run_distributed(_hidden_then_new, world_size=2)[0]
    assert hidden["available"] == {"all_gather_single": False, "reduce_scatter_single": False}
    assert hidden["full"] == [0, 1, 2, 3, 1, 2, 3, 4]
    assert hidden["shard"] == [1.0, 3.0]  # slice 0 of (0,1,2,3) + (1,2,3,4)
    assert hidden["bytes"] == {"all_gather": 32, "reduce_scatter": 16}
    has_new = hasattr(dist.distributed_c10d, "all_gather_single")  # torch >= 2.13
    assert available == {"all_gather_single": has_new, "reduce_scatter_single": has_new}
    assert calls == {"all_gather": 1}


def test_a_course_call_of_a_hidden_name_names_its_file(tmp_path, monkeypatch):
    # the frame check, on a module laid out as a day folder of the repo
    monkeypatch.setattr(compat, "_REPO", str(tmp_path))
    day = tmp_path / "day99_x"
    day.mkdir()
    (day / "m.py").write_text("def call(fn):\n    return fn(1)\n")
    namespace: dict = {}
    exec(compile((day / "m.py").read_text(), str(day / "m.py"), "exec"), namespace)
    hidden = compat._hidden("all_gather_single", lambda *a: "real")
    with pytest.raises(AttributeError, match=r"day99_x/m.py:2 calls torch.distributed"):
        namespace["call"](hidden)
    assert hidden(1) == "real"  # called from a test, not from the course: forwarded


# a day's module, as day15_collectives/collectives.py calls the two collectives: through compat
PROBE = """import torch
import torch.distributed as dist

from dtl import compat


def reduce_then_gather(x):
    shard = torch.empty(x.numel() // dist.get_world_size())
    compat.reduce_scatter_single(shard, x)
    full = torch.empty(x.numel())
    compat.all_gather_single(full, shard)
    return shard, full


def gather_directly(x):
    out = torch.empty(x.numel() * dist.get_world_size())
    getattr(dist, "all_gather_single")(out, x)
"""


def _through_a_day_module(root: str):
    compat._REPO = root  # this rank only: tmp_path stands for the repository, day99_probe/ in it
    sys.path.insert(0, root)
    probe = importlib.import_module("day99_probe.collect")
    x = torch.arange(4.0) + 10 * dist.get_rank()
    shard, full = probe.reduce_then_gather(x)
    try:
        probe.gather_directly(x)
        direct = None
    except AttributeError as err:
        direct = str(err)
    return shard.tolist(), full.tolist(), direct


def test_a_day_module_calling_through_compat_runs_as_on_torch_2_11(tmp_path):
    # the guard sees the caller above compat: compat itself must take the old names, since a
    # day's call that reaches a hidden name through compat is refused as a direct one is
    (tmp_path / "day99_probe").mkdir()
    (tmp_path / "day99_probe" / "__init__.py").write_text("")
    (tmp_path / "day99_probe" / "collect.py").write_text(PROBE)
    results = run_distributed(_through_a_day_module, str(tmp_path), world_size=2)
    total = [10.0, 12.0, 14.0, 16.0]  # one process: (0, 1, 2, 3) + (10, 11, 12, 13)
    for rank, (shard, full, direct) in enumerate(results):
        assert shard == total[2 * rank : 2 * rank + 2], rank  # slice r of the sum
        assert full == total, rank
        # not vacuous: this module's own direct call of the new name is refused
        assert direct is not None, rank
        if hasattr(dist.distributed_c10d, "all_gather_single"):  # torch >= 2.13: the guard's
            line = next(i for i, ln in enumerate(PROBE.splitlines(), 1) if "getattr(" in ln)
            assert f"day99_probe/collect.py:{line} calls torch.distributed" in direct, direct


def test_the_course_calls_no_hidden_name_directly():
    # what the hiding catches at run time, caught here for every file, run or not
    for path in nccl_rules.course_sources():
        if path.name == "compat.py":
            continue
        for name in compat.NEW_TO_OLD:
            assert f"dist.{name}(" not in path.read_text(), f"{path}: use dtl.compat.{name}"


def _tool(name: str):
    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOOR = Path(__file__).resolve().parent / "torch_api_floor.txt"


def test_every_torch_name_the_course_writes_exists_in_the_floor_torch(tmp_path):
    api = _tool("torch_api")
    floor = {ln for ln in FLOOR.read_text().splitlines() if ln and not ln.startswith("#")}
    missing = {p: where for p, where in api.used_paths().items() if p not in floor}
    assert not missing, (
        "torch names not in the floor torch's list (tests/torch_api_floor.txt): check they exist "
        f"there (tools/torch_api.py under it) and add them, or go through dtl.compat: {missing}"
    )
    # the check sees a 2.13-only call written out, as it would be by a reader's edit
    new = tmp_path / "day99_new.py"
    new.write_text("import torch.distributed as dist\n\ndist.all_gather_single(a, b)\n")
    assert "torch.distributed.all_gather_single" in api.used_paths([new])
    assert "torch.distributed.all_gather_single" not in floor
