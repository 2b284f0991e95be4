"""Day 22: megatron-core's own GPT, schedules, DDP and optimizer, and our 4-D stack, each equal to
one process; the converter both ways; megatron's groups = the grid's; state and bytes per axis =
formulas.py; parameters per rank and the global gradient norm against one process's tensors cut
by hand (the graded exercises' first graders); the launch scripts' flags; bad input. The
megatron-core tests carry needs_extras("megatron"); the rest run without it.

One spawn per world size: 4 ranks run every megatron-core layout in turn (parallel_state built
and destroyed per layout), 4 ranks every 4-D grid (two with ZeRO-1, distopt.py, one of them over
dp x cp, and two with a ZeRO-1 bug planted, which must fail), 8 ranks the (dp 2, pp 2, tp 2)
grid with ZeRO-1, 2 ranks the gradient norms of hand-cut shards; one more (4 ranks) runs SP's
mutation.

Reference: the dtl GPT in one process on the same global batches, torch's AdamW with Megatron's
decay groups (matrices only) and the same global-norm clipping. Tolerances: losses rtol 1e-5;
gradient norms rtol 1e-5; first-step gradients atol 1e-6; parameters after K AdamW steps atol
1e-5 (fp32; `tiny`'s key bias has a pure-rounding gradient that Adam turns into lr-sized noise at
eps 1e-8: measured gaps 1e-6 to 4e-6, dtl/model.py's docstring).
"""

import importlib.util
import itertools
import os
import shlex
import subprocess

import pytest
import torch

import dtl.megatron as dm
from day22_megatron import (
    distopt,
    formulas,
    layouts,
    megatron_gpt,
    stack,
    train_4d,
    train_megatron,
)
from day22_megatron.ep import EP_AXES
from day22_megatron.megatron_gpt import from_megatron, to_megatron
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import get_batch, load_corpus
from dtl.grid import ParallelGrid
from dtl.model import GPT, loss_fn, preset
from dtl.reduction import gpt_reductions
from dtl.reference import one_process_gpt
from dtl.testing import needs_extras, run_distributed, script_error
from dtl.tp_plan import shard_tensor, tp_shard_of

MEGATRON = needs_extras("megatron")  # on each test that runs megatron-core, not on the file

K, T, GBS = 3, 16, 8
TOL = dict(losses=dict(rtol=1e-5, atol=0), grads=dict(rtol=0, atol=1e-6), params=1e-5)
MEGATRON_LAYOUTS = {  # name -> train_megatron flags (world 4)
    "tp2-dp2": dict(tensor_model_parallel_size=2),
    "pp2-dp2": dict(pipeline_model_parallel_size=2),
    # (tp 2 x pp 2: the registered megatron-tp2-pp2-sp line, SP on top; pp 2 x vpp 2 x dp 2
    # with the distributed optimizer: the megatron-vpp-distopt line; each against one process)
    "tp2-sp-dp2-distopt": dict(
        tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True
    ),
}
OUR_GRIDS_4 = {  # name -> train_4d flags (world 4)
    "dp2-tp2": dict(tp=2),  # (pp 2, tp 2): the registered line ours-tp2-pp2 checks it
    "dp2-pp2": dict(pp=2),
    "cp2-tp2": dict(cp=2, tp=2),
    "dp2-pp2-vpp2": dict(pp=2, chunks=2),
    "dp2-tp2-sp": dict(tp=2, sp=True),
    # ZeRO-1 (distopt.py): Adam's m and v sliced over dp, gradients reduce-scattered
    "dp2-tp2-zero1": dict(tp=2, distributed_optimizer=True),
    # ZeRO-1 over dp x cp: a gradient averaged over 4 ranks, its moments sliced 4 ways
    "cp2-dp2-zero1": dict(cp=2, distributed_optimizer=True),
}
# with ZeRO-1; the plain grid's all-reduce at 8 ranks: the registered ours-ep2-pp2-tp2 line
OUR_GRIDS_8 = {"dp2-pp2-tp2-zero1": dict(tp=2, pp=2, distributed_optimizer=True)}
ZERO1 = dict(tp=2, distributed_optimizer=True)  # the planted bugs' grid (dp 2 x tp 2)
COMMON = dict(model="tiny", num_layers=4, global_batch_size=GBS, micro_batch_size=1)


def _reference(grad_norms=None):
    """The one-process run every layout must equal (the same for all: one model, one batch)."""
    corpus = load_corpus(tokenizer="byte")
    norms = [] if grad_norms is None else grad_norms
    losses, gpt = one_process_gpt(
        preset("tiny", n_layer=4), corpus.train, seq_len=T, rows=GBS, steps=K, lr=1e-3,
        weight_decay=0.1, clip_grad=1.0, grad_norms=norms,
    )  # fmt: skip
    return losses, norms, dict(gpt.named_parameters(remove_duplicate=False))


def _reference_grads():
    corpus = load_corpus(tokenizer="byte")
    gpt = GPT(preset("tiny", n_layer=4), seed=0)
    x, y = get_batch(corpus.train, T, GBS, seed=0, step=0)
    loss_fn(gpt(x), y).backward()
    return {n: p.grad for n, p in gpt.named_parameters(remove_duplicate=False)}


def _check_run(name, got, reference):
    losses, norms, params = reference
    torch.testing.assert_close(got["losses"], losses, **TOL["losses"], msg=name)
    torch.testing.assert_close(got["norms"], norms, rtol=1e-5, atol=0, msg=name)
    gap = max((got["full"][k] - params[k].detach()).abs().max().item() for k in params)
    assert gap <= TOL["params"], f"{name}: params differ by {gap:.1e} after {K} steps"
    return gap


# --- megatron-core ------------------------------------------------------------------------------


def _megatron_body(tmp, layouts_):
    info = dtl_dist.init()
    out = {}
    for name, flags in layouts_.items():
        cfg = train_megatron.Config(
            **COMMON, **flags, seq_length=T, train_iters=K, out_dir=f"{tmp}/{name}"
        )
        cfg.validate()
        lay = cfg.layout
        grid = ParallelGrid(tp=lay.tp, pp=lay.pp, dp=lay.dp)
        r = train_megatron.run(cfg, info, grid)
        held = r["params"] == formulas.params_per_rank(cfg.model_config(), lay, grid.pp_rank)
        out[name] = dict(
            losses=r["losses"], norms=r["norms"], full=r["full"], roundtrip=r["roundtrip"],
            groups_equal=r["groups"] == dm.grid_group_ranks(grid), params_equal=held,
            adam=r["state"]["optim"] // 8, buffer=r["buffer"], buffer_formula=r["buffer_formula"],
            params=r["params"],
        )  # fmt: skip
    return out


def _megatron_sp_without_the_norm_flag(tmp):
    """SP with torch's LayerNorm unflagged: finalize_model_grads leaves its partial grads."""
    original = megatron_gpt.SequenceParallelLayerNorm.__init__

    def unflagged(self, config, hidden_size, eps=1e-5):
        torch.nn.LayerNorm.__init__(self, hidden_size, eps=eps)

    megatron_gpt.SequenceParallelLayerNorm.__init__ = unflagged
    try:
        return _megatron_body(tmp, {"sp-unflagged": MEGATRON_LAYOUTS["tp2-sp-dp2-distopt"]})
    finally:
        megatron_gpt.SequenceParallelLayerNorm.__init__ = original


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron"))
    per_rank = run_distributed(_megatron_body, tmp, MEGATRON_LAYOUTS, world_size=4, timeout_s=240)
    return per_rank


@MEGATRON
@pytest.mark.parametrize("name", list(MEGATRON_LAYOUTS))
def test_megatron_core_layouts_train_like_one_process(megatron_results, name):
    reference = _reference()
    rank0 = megatron_results[0][name]
    _check_run(name, rank0, reference)
    for rank, res in enumerate(megatron_results):
        assert res[name]["groups_equal"], f"{name}: rank {rank}'s megatron groups != the grid's"
        assert res[name]["params_equal"], f"{name}: rank {rank} holds another parameter count"
    assert rank0["roundtrip"] == 0.0  # dtl -> megatron shards -> dtl, bit for bit


@MEGATRON
def test_megatron_sp_needs_the_layernorm_gradients_all_reduced(tmp_path):
    # the mutation: without the flag each TP rank keeps its own partial LayerNorm gradient
    per_rank = run_distributed(_megatron_sp_without_the_norm_flag, str(tmp_path), world_size=4)
    got = per_rank[0]["sp-unflagged"]
    _, _, params = _reference()
    gap = max((got["full"][k] - params[k].detach()).abs().max().item() for k in params)
    assert gap > 100 * TOL["params"], f"unflagged SP still matched ({gap:.1e})"


def test_converter_round_trips_exactly_and_interleaves_qkv_per_head():
    cfg = preset("tiny", n_layer=3, tie_weights=False)
    dense = GPT(cfg, seed=1).state_dict()
    mstate = to_megatron(dense, cfg)
    assert "output_layer.weight" in mstate and "decoder.layers.2.mlp.linear_fc2.bias" in mstate
    back = from_megatron(mstate, cfg)
    assert back.keys() == dense.keys()
    assert all(torch.equal(back[k], dense[k]) for k in dense)
    # megatron's rows for head h: [q_h; k_h; v_h]; ours: all Q heads, then K, then V
    hs, C = cfg.head_dim, cfg.n_embd
    ours = dense["blocks.0.attn.c_attn.weight"]
    theirs = mstate["decoder.layers.0.self_attention.linear_qkv.weight"]
    for h in range(cfg.n_head):
        for j, part in enumerate("qkv"):
            want = ours[j * C + h * hs : j * C + (h + 1) * hs]
            got = theirs[(3 * h + j) * hs : (3 * h + j + 1) * hs]
            assert torch.equal(got, want), f"head {h} {part}"
    tied = preset("tiny")
    assert "output_layer.weight" not in to_megatron(GPT(tied).state_dict(), tied)


# --- our 4-D stack -----------------------------------------------------------------------------


def _slices_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    true = distopt.DistributedOptimizer.reduce_scatter_gradients

    def summed(self):
        sent = true(self)
        for g in self.groups:
            g.shard.grad.mul_(g.size)  # the division by d undone
        return sent

    monkeypatch.setattr(distopt.DistributedOptimizer, "reduce_scatter_gradients", summed)


def _replicas_counted_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distopt, "counts_in_norm", lambda record, grid: True)


# ZeRO-1 with a bug planted, run in the 4-rank spawn: label -> (its grid, what plants it); each
# must fail the one-process check
ZERO1_PLANTS = {
    "zero1: slices summed, not averaged": (ZERO1, _slices_summed),
    "zero1: replicas counted on every tp rank": (ZERO1, _replicas_counted_everywhere),
}


def _our_body(tmp, grids, plants=None):
    """Every grid of `grids` (name -> train_4d flags) trained; `plants`: name -> the functions
    that plant a bug before it trains."""
    plants = plants or {}
    info = dtl_dist.init()
    out = {}
    for name, flags in grids.items():
        cfg = train_4d.Config(**COMMON, **flags, seq_len=T, steps=K, check=False)
        cfg.out_dir = f"{tmp}/{name}"
        cfg.validate()
        lay = cfg.layout
        grid = ParallelGrid(dp=lay.dp, pp=lay.pp, cp=lay.cp, tp=lay.tp)
        with pytest.MonkeyPatch.context() as monkeypatch:
            for plant in plants.get(name, ()):
                plant(monkeypatch)
            r = train_4d.run(cfg, info, grid)
        _, exact = train_4d.measured_vs_formula(cfg, grid, r)
        out[name] = dict(
            losses=r["losses"], norms=r["norms"], full=r["full"], exact=exact,
            grads=_first_step_grads(cfg, grid, info), adam=r["state"]["optim"] // 8,
            buffer=r["state"]["grads"] // 4,
        )  # fmt: skip
    return out


def _first_step_grads(cfg, grid, info):
    """The averaged gradients of step 0 (before clipping), as full dense tensors."""
    s = stack.build_stack(
        cfg.model_config(), grid, micro_batch_size=1, microbatches=cfg.microbatches,
        seq_len=T, schedule="interleaved" if cfg.chunks > 1 else "1f1b", chunks=cfg.chunks,
        sp=cfg.sp,
    )  # fmt: skip
    corpus = load_corpus(tokenizer="byte")
    stack.forward_backward(s, train_4d.micro_batches(corpus.train, cfg, 0, grid, info.device))
    stack.sync_gradients(s)
    return stack.full_state(s, grads=True)


def _check_ours(name, got):
    _check_run(name, got, _reference())
    ref = _reference_grads()
    assert got["grads"].keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got["grads"][k], ref[k], **TOL["grads"], msg=f"{name} {k}")
    assert got["exact"], f"{name}: state or bytes per axis differ from formulas.py on some rank"


@pytest.mark.parametrize("name", list(OUR_GRIDS_4))
def test_our_4d_stack_equals_one_process_at_4_ranks(our_results_4, name):
    _check_ours(name, our_results_4[0][name])


@pytest.fixture(scope="module")
def our_results_4(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ours4"))
    grids = {**OUR_GRIDS_4, **{label: flags for label, (flags, _) in ZERO1_PLANTS.items()}}
    plants = {label: (plant,) for label, (_, plant) in ZERO1_PLANTS.items()}
    return run_distributed(_our_body, tmp, grids, plants, world_size=4, timeout_s=240)


@pytest.mark.parametrize("name", list(ZERO1_PLANTS))
def test_a_planted_zero1_bug_fails_the_one_process_check(our_results_4, name):
    with pytest.raises(AssertionError):
        _check_run(name, our_results_4[0][name], _reference())


@MEGATRON
def test_megatron_cores_distributed_optimizer_and_ours_keep_each_moment_once(
    megatron_results, our_results_4
):
    """tp 2 x dp 2 on the same weights and batches: megatron-core's DistributedOptimizer
    (tp2-sp-dp2-distopt; SP changes no parameter) and distopt.py (dp2-tp2-zero1), each equal to
    one process (the tests above). Rank by rank: both keep Adam's m and v for their dp slice
    only, so over a dp group every moment of the TP shard's P parameters exists once (ours also
    for the padding of its flats to d; megatron's slices exclude its padding); megatron's grad
    buffer is its padding rule's size (each parameter starting at a multiple of 64 elements,
    the bucket ending at a multiple of lcm(d, 128)), ours P plus fewer than d per group."""
    theirs = [r["tp2-sp-dp2-distopt"] for r in megatron_results]
    ours = [r["dp2-tp2-zero1"] for r in our_results_4]
    groups = len(ours[0]["full"])  # a bound: at most one flat group per parameter
    for tp_rank in (0, 1):  # TP innermost: the dp group of tp rank t is ranks t and t + 2
        dp_group = [
            r for r in range(4) if ParallelGrid(tp=2, dp=2, world_size=4, rank=r).tp_rank == tp_rank
        ]
        P = theirs[dp_group[0]]["params"]
        assert sum(theirs[r]["adam"] for r in dp_group) == P  # each moment once, no padding
        assert sum(ours[r]["adam"] for r in dp_group) == ours[dp_group[0]]["buffer"]
        assert 0 <= ours[dp_group[0]]["buffer"] - P < 2 * groups
        for r in dp_group:
            assert theirs[r]["buffer"] == theirs[r]["buffer_formula"] >= P


def test_our_4d_stack_dp2_pp2_tp2_with_zero1_equals_one_process_at_8_ranks(tmp_path):
    per_rank = run_distributed(_our_body, str(tmp_path), OUR_GRIDS_8, world_size=8, timeout_s=240)
    for name in OUR_GRIDS_8:  # with ZeRO-1 (Megatron's distributed optimizer)
        _check_ours(name, per_rank[0][name])


def test_grad_norm_counts_each_tensor_once():
    # a replicated tensor counted on every TP rank, or the tied copy on the last stage, would
    # inflate the norm: the rule, name by name, on a TP rank 1 that also holds the last stage
    grid = ParallelGrid(tp=2, pp=2, world_size=4, rank=3)  # pp 1, tp 1: no process group
    gpt = GPT(preset("tiny"))
    s = stack.Stack(grid, gpt, None, [], {}, loss_fn, None, gpt_reductions(gpt))
    assert stack._counted_once("blocks.0.attn.c_attn.weight", s)  # a column shard
    assert stack._counted_once("blocks.0.attn.c_attn.bias", s)  # split with its rows
    assert stack._counted_once("blocks.0.mlp.c_proj.weight", s)  # a row shard
    assert not stack._counted_once("blocks.0.mlp.c_proj.bias", s)  # replicated: rank 0 only
    assert not stack._counted_once("blocks.0.ln_1.weight", s)
    assert not stack._counted_once("lm_head.weight", s)  # wte stands for the tied weight
    assert stack._counted_once("wte.weight", s)
    # an MoE on tp 2 x ep 2, rank 2 (ep 1, tp 0): its own experts, once per TP group; a dense
    # tensor is the same on both ep ranks (averaged over ep): the ep rank 0 counts it
    grid = ParallelGrid(ep=2, tp=2, axes=EP_AXES, world_size=4, rank=2)
    moe = GPT(preset("tiny-moe"))
    s = stack.Stack(grid, moe, None, [], {}, loss_fn, None, gpt_reductions(moe, EP_AXES))
    assert stack._counted_once("blocks.0.mlp.experts.3.c_fc.weight", s)  # routed over ep
    assert not stack._counted_once("blocks.0.attn.c_attn.weight", s)  # ep rank 1
    assert not stack._counted_once("blocks.0.mlp.router.weight", s)
    assert not stack._counted_once("wte.weight", s)


def _stage_of(name, n_layer, pp):
    """The pipeline stage that holds a one-process tensor: wte and wpe the first, ln_f and
    lm_head (with tied weights: a copy of wte when pp > 1) the last, blocks n_layer / pp each."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) // (n_layer // pp)
    return 0 if name.startswith(("wte.", "wpe.")) else pp - 1


def _rank_tensors(gpt, grid, grads=False):
    """{one-process name: the tensor (or gradient) rank (grid.pp_rank, grid.tp_rank) holds}, cut
    from the one-process model by hand: its stage's tensors, each as dtl.tp_plan.shard_tensor
    splits it over the TP ranks (replicated ones whole)."""
    out = {}
    for name, p in gpt.named_parameters(remove_duplicate=False):
        if _stage_of(name, gpt.cfg.n_layer, grid.pp_size) != grid.pp_rank:
            continue
        module, _, kind = name.rpartition(".")
        t = (p.grad if grads else p).detach()
        shard = tp_shard_of(module) if grid.tp_size > 1 else None
        if shard is not None:
            t = shard_tensor(t, shard, kind == "bias", grid.tp_rank, grid.tp_size)
        out[name] = t
    return out


def _norms_of_hand_cut_grads():
    """Each of 2 ranks as tp 2, pp 2 and dp 2: a Stack holding its cut of one set of dense
    gradients (random, seeded: the same on both ranks); global_grad_norm on it, and the norm."""
    dtl_dist.init()
    grids = {"tp2": ParallelGrid(tp=2), "pp2": ParallelGrid(pp=2), "dp2": ParallelGrid(dp=2)}
    out = {}
    for tie in (True, False):
        gpt = GPT(preset("tiny", n_layer=4, tie_weights=tie), seed=0)
        gen = torch.Generator().manual_seed(0)
        for p in gpt.parameters():  # each tensor once: a tied wte and lm_head share one gradient
            p.grad = torch.randn(p.shape, generator=gen)
        dense = torch.stack([p.grad.double().pow(2).sum() for p in gpt.parameters()]).sum()
        for name, grid in grids.items():
            named = {}
            for n, g in _rank_tensors(gpt, grid, grads=True).items():
                named[n] = torch.nn.Parameter(torch.zeros_like(g))
                named[n].grad = g.clone()
            table = gpt_reductions(gpt)
            s = stack.Stack(grid, gpt, None, list(named.values()), named, loss_fn, None, table)
            out[name, tie] = stack.global_grad_norm(s), dense.sqrt().item()
    return out


def test_global_grad_norm_of_tp_pp_and_dp_ranks_is_one_process_norm():
    # a replicated tensor counted on both TP ranks, a tied copy counted twice, a stage left out,
    # or the squares summed over the DP ranks too: each moves the norm off the dense one
    for rank, got in enumerate(run_distributed(_norms_of_hand_cut_grads, world_size=2)):
        for (grid, tie), (norm, dense) in got.items():
            assert norm == pytest.approx(dense, rel=1e-12), (
                f"{grid} (tied {tie}), rank {rank}: {norm!r}, one process {dense!r}"
            )


# --- formulas, scripts, bad input --------------------------------------------------------------


def test_params_formula_over_all_stages_is_the_model_plus_the_tied_copy():
    # the formula summed over stages (megatron's per-rank counts are checked on every rank above)
    cfg = preset("tiny", n_layer=4)
    for pp in (1, 2, 4):
        lay = layouts.Layout(pp=pp)
        total = sum(formulas.params_per_rank(cfg, lay, r) for r in range(pp))
        copies = (pp > 1) * cfg.vocab_size * cfg.n_embd  # the last stage's tied copy
        assert total == sum(p.numel() for p in GPT(cfg).parameters()) + copies


def test_params_per_rank_is_what_each_rank_holds_cut_from_one_process():
    # every (tp, pp) rank's tensors counted: its stage's, its TP shard of each (dtl.model's plan)
    for name, untied in [("tiny", False), ("tiny", True), ("tiny-nobias", False)]:
        cfg = preset(name, n_layer=4, n_head=4, tie_weights=not untied)
        gpt = GPT(cfg)
        for tp, pp in [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (4, 4)]:
            lay = layouts.Layout(tp=tp, pp=pp)
            for pp_rank, tp_rank in itertools.product(range(pp), range(tp)):
                grid = ParallelGrid(tp=tp, pp=pp, world_size=tp * pp, rank=pp_rank * tp + tp_rank)
                held = _rank_tensors(gpt, grid)
                if cfg.tie_weights and pp == 1:
                    held.pop("lm_head.weight")  # wte.weight itself, held once
                want = sum(t.numel() for t in held.values())
                got = formulas.params_per_rank(cfg, lay, pp_rank)
                assert got == want, f"{cfg} tp {tp} pp {pp}: rank ({pp_rank}, {tp_rank})"


LAUNCH = os.path.join(os.path.dirname(train_megatron.__file__), "launch")


@MEGATRON
@pytest.mark.parametrize(
    "script, world",
    [("train_2gpu.sh", 2), ("train_4gpu.sh", 4), ("train_8gpu.sh", 8), ("train_2node.sh", 16)],
)
def test_launch_scripts_pass_flags_train_megatron_accepts_for_their_gpu_count(
    script, world, monkeypatch, tmp_path
):
    env = {**os.environ, "DRY_RUN": "1", "RDZV_HOST": "10.0.0.1"}
    line = subprocess.run(
        ["bash", os.path.join(LAUNCH, script)], capture_output=True, text=True, env=env, check=True
    ).stdout
    words = shlex.split(line)
    assert (
        words[0] == "torchrun" and words[words.index("-m") + 1] == "day22_megatron.train_megatron"
    )
    nproc = int(words[words.index("--nproc_per_node") + 1])
    nnodes = int(words[words.index("--nnodes") + 1])
    assert nproc * nnodes == world
    assert "--node_rank" not in words  # c10d numbers the nodes; torchrun ignores it there
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = words[words.index("-m") + 2 :] + [f"--out_dir={tmp_path}"]
    cfg = dtl_config.load(train_megatron.Config, args)  # every flag known, the layout valid
    assert cfg.model == "gpt2-124m" and cfg.model_config().vocab_size % (128 * cfg.layout.tp) == 0


@MEGATRON
def test_a_launch_script_runs_on_cpu_as_written(tmp_path):
    env = {
        **os.environ, "MODEL": "tiny", "SEQ_LENGTH": "16", "MICRO_BATCH_SIZE": "1",
        "GLOBAL_BATCH_SIZE": "4", "TRAIN_ITERS": "2",
    }  # fmt: skip
    proc = subprocess.run(
        ["bash", os.path.join(LAUNCH, "train_2gpu.sh"), f"--out_dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary: day22 megatron-core tp2-pp1-sp-dp1" in proc.stdout
    assert "losses match one process yes" in proc.stdout


@MEGATRON
def test_bad_layout_is_one_line_before_any_collective():
    line = script_error(
        "day22_megatron.train_megatron", "--tensor-model-parallel-size=3", env={"WORLD_SIZE": "4"}
    )
    assert "tp 3 x pp 1 x cp 1 = 3 does not divide the world size 4" in line


PP2 = "--pipeline-model-parallel-size=2"
VPP = "--num-layers-per-virtual-pipeline-stage"


VALIDATED = [  # train_megatron's validate(): where megatron-core is installed (its first check)
    (train_megatron, [PP2, f"{VPP}=3"], "2 layers do not split into pp 2 x chunks of 3 layers"),
    (
        train_megatron,
        [PP2, f"{VPP}=1", "--num-layers=4", "--global-batch-size=6"],
        "interleaved 1F1B needs the micro-batches per DP rank (3) to be a multiple of pp 2",
    ),
    (
        train_megatron,
        ["--global-batch-size=7"],
        "global batch 7 is not divisible by micro-batch 1 x dp 4 = 4",
    ),
    (train_megatron, ["--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
    (
        train_megatron,
        ["--tensor-model-parallel-size=4"],
        "2 attention heads do not split over tp 4",
    ),
    (train_megatron, ["--precision=bf16"], "megatron-core trains bf16 on cuda only"),
]
WITHOUT_MEGATRON = [  # our stack's checks, and a value the parser refuses before validate()
    (train_4d, ["--pp=2", "--cp=2"], "this stack runs CP and SP without PP only"),
    (train_4d, ["--chunks=2"], "--chunks=2 needs --pp >= 2"),
    (train_megatron, ["--precision=fp8"], "megatron-core does not train in fp8"),
    (train_4d, ["--tp=2", "--seq_len=64"], "seq_length 64 exceeds the model's 32 positions"),
]


@pytest.mark.parametrize(
    "script, args, message",
    [pytest.param(*case, marks=MEGATRON) for case in VALIDATED] + WITHOUT_MEGATRON,
)
def test_bad_input_is_a_one_line_config_error(script, args, message, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(dtl_config.ConfigError) as err:
        dtl_config.load(script.Config, [*args, f"--out_dir={tmp_path}"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_megatron_core_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "megatron" else real(name, *a)
    )
    with pytest.raises(dtl_config.ConfigError, match=r"pip install -e '\.\[megatron\]'"):
        train_megatron.Config().validate()


def test_plan_picks_data_parallel_for_gpt2_and_model_parallel_only_when_memory_forces_it():
    from day22_megatron import planner
    from day22_megatron.step_model import StepModel

    gpt2, big = planner.MODELS["gpt2-124m"], planner.MODELS["gpt-6.6b"]
    kw = dict(per_node=8, step=StepModel(mfu=0.4))
    for gpus in (8, 64):
        rows, best = planner.plan(gpt2, gpus, tokens=524_288, b=16, memory_gb=80, **kw)
        assert best["layout"] == f"tp1-pp1-dp{gpus}"
        assert all(r["layout"].startswith(("tp1", "tp2", "tp4")) for r in rows)  # 12 heads
    rows, best = planner.plan(big, 8, tokens=4_194_304, b=1, memory_gb=80, **kw)
    assert best["layout"] == "tp1-pp1-dp8" and best["memory_gb"] <= 80
    rows, best = planner.plan(big, 8, tokens=4_194_304, b=1, memory_gb=20, **kw)
    assert best["memory_gb"] <= 20 and best["layout"] != "tp1-pp1-dp8"
    assert min(r["memory_gb"] for r in rows) < 20 < max(r["memory_gb"] for r in rows)
    # TP never crosses a node: on 64 GPUs its 32 heads would allow t = 16 or 32, yet t <= 8
    rows, _ = planner.plan(big, 64, tokens=4_194_304, b=1, memory_gb=80, **kw)
    assert max(int(r["layout"].split("-")[0][2:]) for r in rows) <= 8
