"""Day 24: sharded checkpoints saved at one world size load exactly at others; async saves hold
the state of their step; kills, kills during a save and elastic restarts resume bit-identically;
damaged checkpoints are refused with one line; DCP <-> torch.save round-trips exactly.

Exactness is the point here, so every comparison is torch.equal (no tolerance): a checkpoint
either restores the same bits or it is wrong. The kill drills compare float.hex losses and a
sha256 of the final parameters with an uninterrupted run at 2 ranks, where DDP's all-reduce of two
values is a single addition, so the same order every time (at 4 ranks a restart may rebuild
buckets and change the order of additions: equal to rounding, not to the bit).
"""

import io
import json
import os
import shutil
import time
import types

import numpy as np
import pytest
import torch

from day24_checkpoint import ckpt as C
from day24_checkpoint import convert
from day24_checkpoint.drill import Config as DrillConfig
from day24_checkpoint.drill import Drills
from day24_checkpoint.train import Config, build
from dtl.data import get_batch
from dtl.script_server import run_script
from dtl.testing import run_distributed, script_error

TOKENS = np.arange(5000, dtype=np.int64) % 256
CFG = Config(model="tiny", dropout=0.1, global_batch=4, seq_len=16, steps=5, lr=1e-2)


def _info(world):
    return types.SimpleNamespace(device=torch.device("cpu"), world_size=world)


def _step(model, opt, sched, step, rank, world):
    x, y = get_batch(TOKENS, 16, 4 // world, seed=0, step=step, dp_rank=rank, dp_size=world)
    from dtl.model import loss_fn

    loss_fn(model(x), y).backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _full_state(model, opt) -> dict:
    """Model and optimizer state as full tensors (collective under FSDP2), flattened."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in m.items()}
    for fqn, state in o["state"].items():
        for key, v in state.items():
            out[f"optim.{fqn}.{key}"] = v.detach().clone()
    return out


def _save_body(root):
    """World 2: FSDP2 and DDP trained 3 steps and saved (sync); DDP saved async at step 3 while
    training 2 more steps (its DDP all-reduces beside the save's collectives)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for parallel in ("fsdp2", "ddp"):
        torch.manual_seed(rank)  # the same dropout masks for both
        cfg = Config(**{**CFG.__dict__, "parallel": parallel})
        _, model, opt, sched = build(cfg, _info(world))
        for step in range(3):
            _step(model, opt, sched, step, rank, world)
        app = C.AppState(model, opt, sched)
        app.progress = C.Progress(step=3, samples=12)
        ckpt = C.Checkpointer(os.path.join(root, parallel), config={"model": "tiny"})
        ckpt.save(app, 3)
        out[parallel] = _full_state(model, opt)
    cfg = Config(**{**CFG.__dict__, "parallel": "ddp"})
    _, model, opt, sched = build(cfg, _info(world))
    app = C.AppState(model, opt, sched)
    # the writer thread lingers 1 s after its shard is written, so the write outlasts a step:
    # a save that blocked until written (or handed back a future already done) cannot pass
    ckpt = C.Checkpointer(
        os.path.join(root, "async"), async_save=True, on_write=lambda step: time.sleep(1.0)
    )
    trained_while_writing = 0  # steps that ran, start to end, while the write was in flight
    for step in range(5):
        writing = ckpt.pending is not None and not ckpt.pending[0].done()
        _step(model, opt, sched, step, rank, world)
        if writing and not ckpt.pending[0].done():
            trained_while_writing += 1
        if step == 2:
            snapshot = _full_state(model, opt)
            app.progress = C.Progress(step=3, samples=12)
            record = ckpt.save(app, 3)  # returns once the copy is staged
            in_flight = ckpt.pending is not None
    ckpt.wait()
    out["async"] = dict(
        snapshot=snapshot,
        final=_full_state(model, opt),
        blocked_s=record.blocked_s,
        in_flight=in_flight,
        trained_while_writing=trained_while_writing,
    )
    fresh_model, fresh_opt = build(cfg, _info(world))[1:3]
    fresh = C.AppState(fresh_model, fresh_opt, None)
    step = C.Checkpointer(os.path.join(root, "async")).load(fresh)
    out["async"]["loaded"] = _full_state(fresh_model, fresh_opt)
    out["async"]["step"] = step
    return out


def _load_body(root):
    """Any world: fresh models with another seed, loaded from the world-2 checkpoints."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for parallel in ("fsdp2", "ddp"):
        cfg = Config(**{**CFG.__dict__, "parallel": parallel, "seed": 7})
        _, model, opt, sched = build(cfg, _info(world))
        app = C.AppState(model, opt, sched)
        step = C.Checkpointer(os.path.join(root, parallel), config={"model": "tiny"}).load(app)
        out[parallel] = dict(
            state=_full_state(model, opt), step=step, progress=app.progress, lr=sched.last_epoch
        )
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_distributed(_save_body, root, world_size=2, timeout_s=180)


def _assert_equal_states(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("world", [1, 4])
def test_saved_at_world_2_loads_exactly_at_worlds_1_and_4(saved, world):
    root, ranks = saved
    loaded = (
        _load_body(root)
        if world == 1
        else run_distributed(_load_body, root, world_size=4, timeout_s=180)
    )
    for res in [loaded] if world == 1 else loaded:
        for parallel in ("fsdp2", "ddp"):
            _assert_equal_states(res[parallel]["state"], ranks[0][parallel])
            assert res[parallel]["step"] == 3 and res[parallel]["progress"].samples == 12
            assert res[parallel]["lr"] == 3  # the scheduler resumes at its step, too


def test_fsdp2_and_ddp_checkpoints_hold_the_same_training_state(saved):
    _, ranks = saved
    # two ranks, two ways of splitting the work, the same sums: the same bits
    _assert_equal_states(ranks[0]["fsdp2"], ranks[0]["ddp"])


def test_async_save_holds_the_state_of_its_step_while_training_moves_on(saved):
    _, ranks = saved
    for res in ranks:
        a = res["async"]
        assert a["in_flight"], "the async save returned only after writing"
        assert a["trained_while_writing"] >= 1, "no training step ran while the write was in flight"
        _assert_equal_states(a["loaded"], a["snapshot"])
        assert a["step"] == 3
        assert not all(torch.equal(a["final"][k], a["snapshot"][k]) for k in a["snapshot"])


def test_dcp_to_torch_save_and_back_round_trips_exactly(saved, tmp_path):
    root, ranks = saved
    path = C.latest(os.path.join(root, "fsdp2"))
    first, back, second = tmp_path / "a.pt", tmp_path / "dcp", tmp_path / "b.pt"
    convert.to_torch_save(path, str(first))
    convert.from_torch_save(str(first), str(back))
    convert.to_torch_save(str(back), str(second))
    a, b = convert.load_torch_save(str(first)), convert.load_torch_save(str(second))
    _assert_nested_equal(a, b)
    model = a["app"]["model"]
    for name, t in model.items():
        assert torch.equal(t, ranks[0]["fsdp2"][f"model.{name}"]), name


def _assert_nested_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_nested_equal(x, y)
    else:
        assert a == b


def _tiny_app(fill: float) -> C.AppState:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(fill)
    return C.AppState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no group
def test_a_damaged_checkpoint_is_refused_before_a_load_in_one_line_naming_the_file(tmp_path):
    """A checkpoint with its manifest, written without a commit (convert.from_torch_save), then
    damaged five ways: a flipped byte, a truncated shard, a deleted one, meta.json not JSON or
    gone. Each is refused by verify and by a load, in one line naming the file, before DCP reads
    anything (the model keeps its weights); the undamaged copy verifies and loads exactly."""
    saved = _tiny_app(3.0)
    saved.progress = C.Progress(step=3, samples=12)
    torch.save({"app": saved.state_dict()}, tmp_path / "full.pt")
    good = tmp_path / "ckpt" / "step_00000003"
    convert.from_torch_save(str(tmp_path / "full.pt"), str(good))
    for damage in ("flip", "truncate", "delete", "not json", "no meta"):
        copy = tmp_path / "damaged" / damage.replace(" ", "_")
        shutil.copytree(good, copy)
        shard, meta = copy / "__0_0.distcp", copy / C.META
        data = shard.read_bytes()
        if damage == "flip":
            shard.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
                              + data[len(data) // 2 + 1 :])  # fmt: skip
        elif damage == "truncate":
            shard.write_bytes(data[:-1])
        elif damage == "delete":
            shard.unlink()
        elif damage == "not json":
            meta.write_text("{not json")
        else:
            meta.unlink()
        named = str(shard) if damage in ("flip", "truncate", "delete") else C.META
        with pytest.raises(C.CheckpointError) as info:
            C.verify(str(copy))
        assert "\n" not in str(info.value) and named in str(info.value), (damage, info.value)
        fresh = _tiny_app(0.0)
        with pytest.raises(C.CheckpointError, match="is corrupt|is missing|unreadable|no meta"):
            C.Checkpointer(str(tmp_path / "ckpt")).load(fresh, path=str(copy))
        assert torch.equal(fresh.model.weight, torch.zeros(2, 2)), f"{damage}: loaded anyway"
    assert C.verify(str(good))["files"].keys() == {".metadata", "__0_0.distcp"}
    fresh = _tiny_app(0.0)
    assert C.Checkpointer(str(tmp_path / "ckpt")).load(fresh, path=str(good)) == 3
    assert torch.equal(fresh.model.weight, saved.model.weight)


def test_only_committed_checkpoints_are_listed_and_pruned_to_keep(saved):
    root, _ = saved
    assert [os.path.basename(p) for p in C.committed(os.path.join(root, "ddp"))] == [
        "step_00000003"
    ]
    meta = json.load(open(os.path.join(C.latest(os.path.join(root, "ddp")), C.META)))
    assert meta["world_size"] == 2 and set(meta["files"]) >= {".metadata", "__0_0.distcp"}


class _Killed(BaseException):
    """A kill: nothing after it runs, and no `except Exception` catches it."""


class _KillInCommit:
    """Checkpointer._commit killed just before its `at`-th move on the file system (1-based;
    0: never); `done` records the moves it let through, by name. A move is a call of one of
    MOVES (the calls inside one, such as rmtree's unlinks, are part of it); DCP's own writes,
    outside the commit, are not counted."""

    MOVES = ((os, "rename"), (os, "replace"), (os, "fsync"), (os, "remove"), (os, "unlink"),
             (os, "rmdir"), (shutil, "rmtree"), (shutil, "move"))  # fmt: skip

    def __init__(self, monkeypatch):
        self.at, self.done, self.inside = 0, [], False
        for module, name in self.MOVES:
            monkeypatch.setattr(module, name, self._watch(getattr(module, name), name))
        commit = C.Checkpointer._commit

        def watched(ckpt, *args, **kwargs):
            self.inside = True
            try:
                return commit(ckpt, *args, **kwargs)
            finally:
                self.inside = False

        monkeypatch.setattr(C.Checkpointer, "_commit", watched)

    def _watch(self, real, name):
        def move(*args, **kwargs):
            if not self.inside:
                return real(*args, **kwargs)
            if len(self.done) + 1 == self.at:
                raise _Killed(f"killed before move {self.at} ({name})")
            self.done.append(name)
            self.inside = False
            try:
                return real(*args, **kwargs)
            finally:
                self.inside = True

        return move


def _committed_step(path: str) -> int:
    """The step a checkpoint folder holds, read by DCP itself (no manifest check): its weights
    are filled with the step number, so a mixed or half-written folder shows."""
    import torch.distributed.checkpoint as dcp

    app = _tiny_app(-1.0)
    dcp.load({"app": app}, checkpoint_id=path, no_dist=True)
    step = app.progress.step
    assert torch.equal(app.model.weight, torch.full((2, 2), float(step))), path
    with open(os.path.join(path, C.META)) as f:  # the manifest lists what is there
        assert set(json.load(f)["files"]) == set(os.listdir(path)) - {C.META}, path
    return step


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no group
@pytest.mark.parametrize("first, second", [(1, 2), (2, 2)], ids=["new step", "same step"])
def test_a_kill_at_any_move_of_the_commit_leaves_the_old_checkpoint_or_the_new(
    tmp_path, monkeypatch, first, second
):
    """A checkpoint committed, then the next commit (another step, or the same step again)
    killed before each of its moves in turn; keep=1, so the commit also deletes the older one.
    Whatever the moment: `latest` names a whole checkpoint, the old one or the new, and a
    restart leaves no .tmp or .old folder behind. The commit makes each file durable (fsync)
    before the move that makes it visible, and replaces `latest` whole (a new file), never
    rewrites it in place."""
    kill = _KillInCommit(monkeypatch)

    def two_saves(root: str, at: int) -> bool:
        ckpt, app = C.Checkpointer(root, keep=1), _tiny_app(float(first))
        app.progress.step = first
        kill.at = 0
        ckpt.save(app, first)
        before = os.stat(os.path.join(root, C.LATEST)).st_ino
        with torch.no_grad():
            app.model.weight.fill_(float(second))
        app.progress.step = second
        kill.at, kill.done = at, []
        try:
            ckpt.save(app, second)
        except _Killed:
            return True
        assert os.stat(os.path.join(root, C.LATEST)).st_ino != before, "latest rewritten in place"
        return False

    whole = str(tmp_path / "whole")
    assert not two_saves(whole, 0)
    moves = kill.done
    assert sorted(os.listdir(whole)) == [C.LATEST, C.step_dir("", second)], "keep=1"
    assert _committed_step(C.latest(whole)) == second
    renames = [i for i, m in enumerate(moves) if m in ("rename", "replace", "move")]
    assert len(renames) >= 2 and "fsync" in moves[: renames[0]], f"no fsync before {moves}"
    assert "fsync" in moves[renames[0] : renames[-1]], f"latest: no fsync before it moves {moves}"
    for at in range(1, len(moves) + 1):
        root = str(tmp_path / f"killed_{at}")
        assert two_saves(root, at)
        for when in ("as the kill left it", "after a restart's clean-up"):
            where = f"killed before move {at} of {moves}, {when}"
            try:
                path = C.latest(root)
            except C.CheckpointError as e:
                pytest.fail(f"{where}: {e}")
            assert path is not None, f"{where}: no latest"
            assert _committed_step(path) in (first, second), where
            C.Checkpointer(root, keep=1)  # a restart: stale .tmp removed, a .old put back
        left = [n for n in os.listdir(root) if n.startswith(C.PREFIX) and "." in n]
        assert not left, f"killed before move {at} of {moves}: {left} left after a restart"


def test_a_fresh_run_over_an_old_folder_keeps_its_own_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    app = C.AppState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    old = C.Checkpointer(str(tmp_path), keep=2)
    for step in (8, 12):
        old.save(app, step)
    new = C.Checkpointer(str(tmp_path), keep=2)
    new.save(app, 4)  # retention goes by commit order, not by step number
    assert C.latest(str(tmp_path)).endswith("step_00000004")
    assert [os.path.basename(p) for p in C.committed(str(tmp_path))] == [
        "step_00000012",
        "step_00000004",
    ]
    new.save(app, 4)  # the same step again: set aside, replaced, never dangling
    assert C.latest(str(tmp_path)).endswith("step_00000004")
    os.rename(tmp_path / "step_00000004", tmp_path / "step_00000004.old")  # a crash mid-commit
    assert C.latest(str(tmp_path)).endswith("step_00000004.old")
    C.Checkpointer(str(tmp_path))  # start-up puts it back
    assert C.latest(str(tmp_path)).endswith("step_00000004")
    with pytest.raises(C.CheckpointError, match="keep must be >= 1"):
        C.Checkpointer(str(tmp_path), keep=0)


def test_rng_state_round_trips_as_bytes():
    torch.manual_seed(3)
    data = C.rng_bytes()
    first = torch.rand(4)
    C.set_rng_bytes(data)
    assert torch.equal(torch.rand(4), first)


# --- the drills: torchrun, SIGKILL, restarts ------------------------------------------------------


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("drills"))
    # each job forked from an interpreter that imported torch already (dtl.script_server)
    return Drills(DrillConfig(out_dir=out, steps=10, save_every=3), run_module=run_script)


@pytest.fixture(scope="module")
def tp_drills(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp_drills"))
    cfg = DrillConfig(out_dir=out, steps=8, save_every=3, parallel="tp")
    return Drills(cfg, run_module=run_script)


def test_a_killed_rank_of_a_tensor_parallel_run_resumes_bit_identical(tp_drills):
    """The same drill on day 22's stack at tp 2: its checkpoint is sharded.py's (every TP shard a
    DTensor); the resumed run's losses and final parameters equal an uninterrupted run's."""
    result = tp_drills.kill_rank(step=5)
    assert result["resumed_from"] == 3, result["tail"]
    assert result["ok"], result["tail"]


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_loaded(drills):
    result = drills.kill_during_save()
    assert result["resumed_from"] == 3, result["tail"]  # the step-6 save was never committed
    assert result["ok"], result["tail"]


def test_two_agents_train_together_and_a_second_node_joining_continues_the_run(drills):
    result = drills.elastic()
    assert result["two_agents_identical"], result["tail"]
    assert result["grew"] and result["resumed_from"] is not None, result["tail"]


# --- bad input ----------------------------------------------------------------------------------


def test_train_script_rejects_bad_checkpoints_and_folders_with_one_line(
    drills, tmp_path, monkeypatch
):
    from dtl import config as dtl_config

    ref = drills.reference()
    path = C.latest(os.path.join(ref.out_dir, "ckpt"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # the script itself, once: exit 2 and one line, before any process group
    line = script_error(
        "day24_checkpoint.train", f"--resume={path}", "--model=tiny-nobias", env={"WORLD_SIZE": "2"}
    )
    assert "is from another model config: bias True (checkpoint) vs False" in line, line
    monkeypatch.setenv("WORLD_SIZE", "2")  # the same parse, in this process, for the others
    for args, message in [
        (["--resume=latest", f"--out_dir={tmp_path / 'empty'}"], "holds no checkpoint"),
        ([f"--ckpt_dir={blocker}/ckpt"], "ckpt_dir"),
        (["--resume=nowhere"], "is neither auto, none, latest nor a folder"),
    ]:
        with pytest.raises(dtl_config.ConfigError, match=message) as info:
            dtl_config.load(Config, args)
        assert "\n" not in str(info.value)


def test_rng_state_leaves_cuda_alone_when_the_run_is_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: pytest.fail("read CUDA's RNG"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: pytest.fail("set CUDA's RNG"))
    data = C.rng_bytes()
    assert set(torch.load(io.BytesIO(data), weights_only=True)) == {"cpu"}
    C.set_rng_bytes(data)


def test_drill_jobs_run_gloo_unless_told_to_choose():
    from day24_checkpoint.drill import clean_env

    assert clean_env()["DTL_BACKEND"] == "gloo" and clean_env(X="1")["X"] == "1"
    assert clean_env("auto").get("DTL_BACKEND") == os.environ.get("DTL_BACKEND")
    line = script_error("day24_checkpoint.drill", "--backend=auto")  # --drill=all: elastic too
    assert "the elastic drill needs backend=gloo" in line
