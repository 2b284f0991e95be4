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
import time
import types

import numpy as np
import pytest
import torch

from day24_checkpoint import ckpt as C
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
    C.to_torch_save(path, str(first))
    C.from_torch_save(str(first), str(back))
    C.to_torch_save(str(back), str(second))
    a, b = C.load_torch_save(str(first)), C.load_torch_save(str(second))
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


def test_a_corrupted_or_missing_file_is_a_one_line_error_naming_it(saved, tmp_path):
    root, _ = saved
    import shutil

    for damage in ("flip", "delete", "meta"):
        copy = tmp_path / damage
        shutil.copytree(C.latest(os.path.join(root, "ddp")), copy)
        shard = copy / "__0_0.distcp"
        if damage == "flip":
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        elif damage == "delete":
            shard.unlink()
        else:
            (copy / C.META).write_text("{not json")
        with pytest.raises(C.CheckpointError) as info:
            C.verify(str(copy))
        msg = str(info.value)
        assert "\n" not in msg
        assert (str(shard) if damage != "meta" else C.META) in msg, msg


def test_only_committed_checkpoints_are_listed_and_pruned_to_keep(saved):
    root, _ = saved
    assert [os.path.basename(p) for p in C.committed(os.path.join(root, "ddp"))] == [
        "step_00000003"
    ]
    meta = json.load(open(os.path.join(C.latest(os.path.join(root, "ddp")), C.META)))
    assert meta["world_size"] == 2 and set(meta["files"]) >= {".metadata", "__0_0.distcp"}


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
