"""Day 28: every strategy trains the ~125M recipe like one process (on `tiny`), resumes exactly,
its model state is what fit.py predicts; the data pipeline feeds the rows dtl.data does.

The strategies come from strategies.REGISTRY. 2-rank spawns run the data-parallel ones, torch's
(ddp, fsdp2) in one and DeepSpeed's (zero2, zero3) in another; 4-rank spawns run the
model-parallel ones, the course's tp_pp at tp 2 x pp 2, tp_sp at tp 2 x dp 2 with full
activation recomputation, ep (tiny-moe) at ep 2 x dp 2, recomputed too, and fsdp2_tp at tp 2 x
dp 2 (with its planted twin, one step) and fsdp2 as HSDP (2 replicas x 2 shards) in one,
megatron at tp 2 x pp 2 in another. Each trains its 6 steps whole; every strategy with a
checkpoint no other test covers (RESUMED_ELSEWHERE) trains them again, in a spawn of its own,
cut in two (stop after step 3 with a checkpoint, resume in a fresh strategy, finish): a resumed
run equal to one process over all 6 steps is an exact resume (any state lost at the cut shows
in steps 4-6), and a broken checkpoint fails the resume tests only. The tests of a library's
strategies skip without its extra; the others need none. Reference: the dtl GPT in one process
(tiny-moe's: one forward per micro-batch of the global batch, each with its own load-balancing
loss, as the ranks run them), the recipe's AdamW (0.9, 0.95), decay on matrices, clipping at 1.0
and the warm-up + cosine schedule, on the same global batches. Tolerances: losses rtol 1e-5
(measured ~1e-7), parameters after 6 steps atol 1e-5 (measured 3e-7 to 8e-7).
"""

import os
import re

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from day28_gpt125m import data as shards
from day28_gpt125m import fit, sharded_tp, train, verdict
from day28_gpt125m.recipe import Recipe, lr_at, make_adamw
from day28_gpt125m.strategies import REGISTRY
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.data import DataError, get_batch
from dtl.model import GPT, num_params, preset
from dtl.testing import needs_extras, run_distributed, script_error

STEPS, CUT = 6, 3
# strategies whose checkpoint another test covers: not cut and resumed here
RESUMED_ELSEWHERE = {
    "tp_sp": "tp_pp's Checkpointer over the same parameters and state: SP keeps no state",
    "ep": "day 24's ep2-dp4 pair reloads every expert and its AdamW moments bit for bit",
}
RESUMABLE = [
    n for n, kind in REGISTRY.items() if not kind.no_checkpoints and n not in RESUMED_ELSEWHERE
]


def _sizes(strategy) -> tuple[int, int, int]:
    """(tp, pp, ep) of a strategy's test run on its world: tp 2 x pp 2, tp 2 x dp 2 without a
    pipeline, ep 2 x dp 2 with experts (dense gradients averaged over all 4 ranks, an expert's
    over its 2 copies, the batch read at 4 data ranks)."""
    kind = REGISTRY[strategy]
    if kind.experts:
        return 1, 1, 2
    if not kind.model_parallel:
        return 1, 1, 1
    return 2, 2 if kind.pipelines else 1, 1


def _model(strategy) -> str:
    return "tiny-moe" if REGISTRY[strategy].experts else "tiny"


def _world(strategy) -> int:
    return 4 if REGISTRY[strategy].model_parallel else 2


def _cases(*, model_parallel=None, libraries=None, measured=False, resumable=False) -> list:
    """The registered strategies of one kind (None: either), each marked with the extras it
    imports: DeepSpeed's and megatron-core's apart, so that torch's and the course's own run
    without them."""
    return [
        pytest.param(n, marks=needs_extras(*kind.extras))
        for n, kind in REGISTRY.items()
        if model_parallel in (None, kind.model_parallel)
        and libraries in (None, bool(kind.extras))
        and (kind.measures_state or not measured)
        and (n in RESUMABLE or not resumable)
    ]


# tp_sp and ep train with full recomputation: SP's all-gathers and reduce-scatters, and the
# experts' all-to-alls (their split sizes too), rerun in backward
RECOMPUTE = {"tp_sp": "full", "ep": "full"}


def _config(strategy, tmp, **kw) -> train.Config:
    tp, pp, ep = _sizes(strategy)
    fields = dict(
        strategy=strategy,
        model=_model(strategy),
        tp=tp,
        pp=pp,
        ep=ep,
        steps=STEPS,
        check=False,
        sample_tokens=0,
        # batches built in the training process: a worker starts Python anew per run (40 s over
        # the file); the loader test and the registered day 28 lines run with workers
        workers=0,
        data_dir=os.path.join(tmp, "data"),
        out_dir=os.path.join(tmp, strategy),
        recompute=RECOMPUTE.get(strategy, "none"),
    )
    cfg = train.Config(**{**fields, **kw})
    cfg.validate()
    return cfg


def _all_reduce_mesh(grid, device_type):
    """A (dp, 1) mesh of this rank's dp group: FSDP2 handed it replicates over dp and shards
    over nothing, all-reducing where it should reduce-scatter."""
    others = grid.ranks.permute(0, 2, 3, 1).reshape(-1, grid.dp_size, 1)  # (pp cp tp, dp, 1)
    mesh = DeviceMesh(device_type, others, mesh_dim_names=("others", "dp", "one"))
    return mesh[("dp", "one")]


# label -> (strategy, its world, train.Config fields): a strategy at another setting, trained in
# the spawn of that world whole and cut in two, checked as the strategies are
VARIANTS = {"fsdp2 as HSDP, 2 replicas x 2 shards": ("fsdp2", 4, dict(replicas=2))}


# label -> (strategy, (class, attribute, planted value)): run in the strategy's spawn, one step
PLANTS = {
    "fsdp2_tp, an all-reduce on the shard axis": (
        "fsdp2_tp",
        (sharded_tp.FSDP2TP, "dp_mesh", staticmethod(_all_reduce_mesh)),
    ),
}


def _runs(tmp, strategies, resumed: bool):
    """Each strategy's losses over the whole schedule, its final parameters and state. Resumed:
    trained cut in two, stopped after step CUT with a checkpoint, restarted from it in a fresh
    strategy, finished; its losses must still be the one-process run's."""
    info = dtl_dist.init()
    out = {}
    for entry in strategies:  # a strategy's name, or a VARIANTS label
        name, _, fields = VARIANTS.get(entry, (entry, 0, {}))
        fields = dict(fields, out_dir=os.path.join(tmp, entry.replace(" ", "-")))
        if resumed:
            ckpt = os.path.join(tmp, f"ck-{entry}")
            cut = _config(name, tmp, **fields, save_every=CUT, stop_at=CUT, ckpt_dir=ckpt)
            grid = cut.grid()
            first = train.run(cut, info, grid)
            r = train.run(_config(name, tmp, **fields, resume=True, ckpt_dir=ckpt), info, grid)
            losses, norms = first["losses"] + r["losses"], first["norms"] + r["norms"]
        else:
            cfg = _config(name, tmp, **fields)
            grid = cfg.grid()
            r = train.run(cfg, info, grid)
            losses, norms = r["losses"], r["norms"]
        out[entry] = dict(
            losses=losses, norms=norms, full=r["full"], state=r["state"], pp_rank=grid.pp_rank,
            sent=r["sent"], predicted_sent=r["predicted_sent"],
        )  # fmt: skip
    for label, (name, (owner, attribute, value)) in PLANTS.items():
        if name in strategies and not resumed:  # one step: its state is measured at the last
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setattr(owner, attribute, value)
                cfg = _config(name, tmp, steps=1, out_dir=os.path.join(tmp, "planted"))
                r = train.run(cfg, info, cfg.grid())
            out[label] = dict(
                state=r["state"], pp_rank=cfg.grid().pp_rank, sent=r["sent"],
                predicted_sent=r["predicted_sent"],
            )  # fmt: skip
    return out


_SPAWNS: dict = {}  # (world, extras, resumed) -> every rank's results of that spawn, or its error


def _entries() -> dict[str, tuple[str, int]]:
    """Every run the spawns train: a strategy's name or a VARIANTS label -> (strategy, world)."""
    runs = {n: (n, _world(n)) for n in REGISTRY}
    return runs | {label: (n, world) for label, (n, world, _) in VARIANTS.items()}


def _ranks(name, tmp_path_factory, resumed: bool = False, entry: str = "") -> list[dict]:
    """Every rank's run of `name`, whole or cut and resumed. The runs of one world that import
    the same extras (torch's ddp and fsdp2; tp_pp, tp_sp, ep and the fsdp2 over TP pair;
    DeepSpeed's; megatron-core's) train in one spawn, started by the first test that asks, in its
    own body: a strategy that raises fails the tests of its spawn, with its traceback, and no
    other. The cut runs spawn apart, so that a broken checkpoint (or day 24's exercises left as
    stubs) fails the resume tests only. `entry`: another result (a VARIANTS or PLANTS label)."""
    world = VARIANTS[entry][1] if entry in VARIANTS else _world(name)
    key = (world, REGISTRY[name].extras, resumed)
    if key not in _SPAWNS:
        group = [
            label
            for label, (n, w) in _entries().items()
            if (w, REGISTRY[n].extras) == key[:2] and (n in RESUMABLE or not resumed)
        ]
        tmp = str(tmp_path_factory.mktemp(f"d28w{key[0]}"))
        try:
            _SPAWNS[key] = run_distributed(
                _runs, tmp, group, resumed, world_size=key[0], timeout_s=300
            )
        except Exception as e:  # the spawn's other tests fail with it too, without a rerun
            _SPAWNS[key] = e
    if isinstance(_SPAWNS[key], Exception):
        raise _SPAWNS[key]
    return [runs[entry or name] for runs in _SPAWNS[key]]


@pytest.fixture(scope="module")
def train_tokens(tmp_path_factory):
    """The training shards every run reads, as the references read them."""
    from dtl.data import load_corpus

    folder = os.path.join(str(tmp_path_factory.mktemp("d28ref")), "train")
    shards.write_shards(load_corpus(tokenizer="byte").train, folder)
    return shards.ShardedTokens(folder)


@pytest.fixture(scope="module")
def reference(train_tokens):
    """strategy -> the one-process run of its model (tiny or tiny-moe), each computed once."""
    runs: dict = {}

    def of(strategy):
        model = _model(strategy)
        if model not in runs:
            runs[model] = verdict.reference(train.Config(model=model, steps=STEPS), train_tokens)
        return runs[model]

    return of


def _check(run, reference, name):
    ref_losses, ref_params, ref_norms = reference(name)
    torch.testing.assert_close(run["losses"], ref_losses, rtol=1e-5, atol=0, msg=name)
    # clipping at 1.0 rescales every step's gradient and Adam is scale-invariant: a gradient off
    # by a constant factor leaves losses and parameters alone; the norm before clipping shows it
    torch.testing.assert_close(run["norms"], ref_norms, rtol=1e-5, atol=0, msg=name)
    assert run["full"].keys() == ref_params.keys(), name
    gap = max((run["full"][k] - ref_params[k].detach()).abs().max().item() for k in ref_params)
    assert gap <= 1e-5, f"{name}: parameters {gap:.1e} from one process"


def _check_state(ranks, name, world=0, replicas=1):
    """Every rank's measured model state is its stage's prediction, to the byte; the fullest
    rank's is what fit.py sizes the run by. `world`, `replicas`: a variant's (VARIANTS)."""
    tp, pp, ep = _sizes(name)
    sizes = dict(world=world or _world(name), tp=tp, pp=pp, ep=ep, replicas=replicas)
    m = preset(_model(name))
    for rank, run in enumerate(ranks):  # every rank: the last pipeline stage holds the head
        got = sum(run["state"].values())
        want = REGISTRY[name].predicted_rank_state(m, **sizes, pp_rank=run["pp_rank"])
        assert got == want, f"{name} rank {rank}: {got:,} vs {want:,.0f}"  # to the byte
    fullest = max(sum(r["state"].values()) for r in ranks)  # what fit.py sizes by
    want = fit.predicted_bytes(m, name, **sizes)["resident"]
    assert fullest == want, f"{name}: fullest {fullest:,} vs {want:,.0f}"


@pytest.mark.parametrize("name", _cases(model_parallel=False, libraries=False))
def test_data_parallel_strategies_train_like_one_process(reference, name, tmp_path_factory):
    _check(_ranks(name, tmp_path_factory)[0], reference, name)


@pytest.mark.parametrize("name", _cases(model_parallel=True, libraries=False))
def test_model_parallel_strategies_train_like_one_process(reference, name, tmp_path_factory):
    _check(_ranks(name, tmp_path_factory)[0], reference, name)


@pytest.mark.parametrize("name", _cases(libraries=True))
def test_deepspeed_and_megatron_core_strategies_train_like_one_process(
    reference, name, tmp_path_factory
):
    _check(_ranks(name, tmp_path_factory)[0], reference, name)


@pytest.mark.parametrize("label", list(VARIANTS))
def test_variants_train_like_one_process_and_hold_their_predicted_state(
    reference, label, tmp_path_factory
):
    """HSDP (fsdp2 with --replicas=2 on 4 ranks): one process's losses, norms and parameters;
    each rank holds 1/2 of the state, not FSDP's 1/4 (a wrap that ignores --replicas fails). Cut
    in two and resumed too, as fsdp2 is (test_strategies_cut_and_resumed_...)."""
    name, world, fields = VARIANTS[label]
    ranks = _ranks(name, tmp_path_factory, entry=label)
    _check(ranks[0], reference, name)
    _check_state(ranks, name, world=world, **fields)


RESUMED_VARIANTS = [label for label, (n, _, _) in VARIANTS.items() if n in RESUMABLE]


@pytest.mark.parametrize("name", [*_cases(resumable=True), *RESUMED_VARIANTS])
def test_strategies_cut_and_resumed_train_like_one_process(reference, name, tmp_path_factory):
    """An exact resume: any state the checkpoint loses shows in the steps after the cut."""
    strategy = VARIANTS[name][0] if name in VARIANTS else name
    run = _ranks(strategy, tmp_path_factory, resumed=True, entry=name)[0]
    _check(run, reference, strategy)


def test_an_moe_reference_in_one_forward_per_step_is_not_what_the_ep_ranks_train(
    tmp_path_factory, reference, train_tokens
):
    """The ranks' load-balancing losses count one micro-batch's tokens each: a reference that runs
    the global batch in one forward (one aux loss over all its tokens) trains another model, and
    the ep run fails against it: the slices are what makes the match."""
    (name,) = [n for n, kind in REGISTRY.items() if kind.experts]
    run = _ranks(name, tmp_path_factory)[0]
    _check(run, reference, name)
    whole = train.Config(model=_model(name), steps=STEPS, global_batch_size=8, micro_batch_size=8)
    one_forward = verdict.reference(whole, train_tokens)  # forwards = 1: one aux loss per step
    with pytest.raises(AssertionError):
        _check(run, lambda _: one_forward, name)


def _check_sent(ranks, name):
    """Every rank's ring bytes per axis in the last step are the strategy's formulas."""
    for rank, run in enumerate(ranks):
        want = run["predicted_sent"]
        assert run["sent"] == pytest.approx(want, rel=1e-12), f"{name} rank {rank}: {run['sent']}"


@pytest.mark.parametrize("name", [n for n, kind in REGISTRY.items() if kind.counts_sent])
def test_bytes_each_axis_sends_in_a_step_are_the_formulas_on_every_rank(name, tmp_path_factory):
    _check_sent(_ranks(name, tmp_path_factory), name)


@pytest.mark.parametrize("label", list(PLANTS))
def test_a_planted_strategy_fails_the_state_and_bytes_checks(label, tmp_path_factory):
    name = PLANTS[label][0]
    planted = _ranks(name, tmp_path_factory, entry=label)
    with pytest.raises(AssertionError):
        _check_state(planted, name)
    with pytest.raises(AssertionError):
        _check_sent(planted, name)


@pytest.mark.parametrize("name", _cases(model_parallel=False, libraries=False, measured=True))
def test_measured_state_of_data_parallel_strategies_is_the_prediction(name, tmp_path_factory):
    _check_state(_ranks(name, tmp_path_factory), name)


@pytest.mark.parametrize("name", _cases(model_parallel=True, libraries=False, measured=True))
def test_measured_state_of_every_rank_is_the_prediction_for_its_stage(name, tmp_path_factory):
    _check_state(_ranks(name, tmp_path_factory), name)


@pytest.mark.parametrize("name", _cases(libraries=True, measured=True))
def test_measured_state_on_deepspeed_and_megatron_core_is_the_prediction(name, tmp_path_factory):
    _check_state(_ranks(name, tmp_path_factory), name)


def test_the_registry_lists_every_strategy_in_the_notes_order():
    """strategies.py imports one module per family for its @register: REGISTRY, --help and
    fit.check's hint list the strategies in the order the notes give them."""
    assert list(REGISTRY) == [
        *("ddp", "fsdp2", "zero2", "zero3", "tp_pp", "tp_sp", "ep", "megatron", "fsdp2_tp"),
        "fsdp2_dtensor_tp",
    ]


# --- the data pipeline -------------------------------------------------------------------------


def test_shards_round_trip_across_boundaries_in_llm_c_format(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 10_000).astype(np.uint16)
    shards.write_shards(tokens, str(tmp_path), shard_tokens=3_000)
    data = shards.ShardedTokens(str(tmp_path))
    assert len(data) == 10_000 and len(data.paths) == 4
    assert np.array_equal(data.read(0, 10_000), tokens)
    assert np.array_equal(data.read(2_990, 3_020), tokens[2_990:6_010])  # three shards
    header = np.fromfile(data.paths[0], dtype=np.int32, count=256)
    assert list(header[:3]) == [20240520, 1, 3_000]
    bad = tmp_path / "shard_00001.bin"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(DataError, match="is truncated"):
        shards.ShardedTokens(str(tmp_path))


def test_step_batches_are_dtl_get_batch_rows_and_a_loader_resumes_at_its_step(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 256, 5_000).astype(np.uint16)
    shards.write_shards(tokens, str(tmp_path), shard_tokens=1_024)
    data = shards.ShardedTokens(str(tmp_path))
    ds = shards.StepBatches(data, 16, 3, dp_rank=1, dp_size=2, seed=7)
    for step in (0, 5):
        x, y = get_batch(tokens, 16, 3, seed=7, step=step, dp_rank=1, dp_size=2)
        assert torch.equal(ds[step][0], x) and torch.equal(ds[step][1], y)
    kw = dict(seq_len=16, rows=3, dp_rank=1, dp_size=2, seed=7, steps=6)
    whole = list(shards.step_loader(data, start_step=0, workers=2, **kw))
    resumed = list(shards.step_loader(data, start_step=3, workers=2, **kw))
    assert [s for s, _ in resumed] == [3, 4, 5]
    for (s1, b1), (s2, b2) in zip(whole[3:], resumed):
        assert s1 == s2 and torch.equal(b1[0], b2[0]) and torch.equal(b1[1], b2[1])


def test_the_schedule_warms_up_linearly_then_decays_to_min_lr():
    r = Recipe(lr=6e-4, min_lr=6e-5, warmup=4, steps=20)
    assert [lr_at(s, r) for s in range(4)] == pytest.approx([1.5e-4, 3e-4, 4.5e-4, 6e-4])
    assert lr_at(4, r) == pytest.approx(6e-4) and lr_at(20, r) == pytest.approx(6e-5)
    lrs = [lr_at(s, r) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_the_recipe_is_gpt3_smalls_and_reaches_adamw_as_written():
    r = train.Config().recipe()  # the script's defaults: what every strategy trains with
    got = (r.lr, r.min_lr, r.weight_decay, r.clip, r.betas, r.eps)
    assert got == (6e-4, 6e-5, 0.1, 1.0, (0.9, 0.95), 1e-8)
    opt = make_adamw(GPT(preset("tiny")), r)
    decay = {g["weight_decay"] for g in opt.param_groups}
    assert decay == {0.1, 0.0}  # matrices decay, biases and norms do not
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in opt.param_groups)
    ds = dict(lr=6e-4, eps=1e-8, weight_decay=0.1, betas=[0.9, 0.95])
    assert r.optim.deepspeed_params() == ds  # what the zero2/zero3 strategies hand DeepSpeed


def test_the_ablations_fused_adamw_and_torch_compile_train_like_their_baselines():
    """The two ablation rows no launch line runs here (its smoke run measures attention only):
    fused AdamW against the for-loop, torch.compile (inductor, on the CPU) against eager, the
    same steps, losses and final parameters."""
    from day28_gpt125m import ablation
    from dtl.data import load_corpus

    # no biases: no gradient is rounding noise that Adam would blow up to a step of lr
    cfg = ablation.Config(model="tiny-nobias", seq_len=16, batch_size=2, steps=2)
    tokens = load_corpus(tokenizer="byte").train
    cpu = torch.device("cpu")
    run = {
        n: ablation.measure(cfg, ablation.VARIANTS[n], tokens, cpu)
        for n in ("AdamW: for-loop", "AdamW: fused", "compile: eager", "compile: torch.compile")
    }
    for new, base, tol in (
        ("AdamW: fused", "AdamW: for-loop", 1e-6),
        ("compile: torch.compile", "compile: eager", 1e-5),  # inductor reorders float sums
    ):
        torch.testing.assert_close(run[new]["losses"], run[base]["losses"], rtol=tol, atol=0)
        for name, p in run[base]["params"].items():
            torch.testing.assert_close(run[new]["params"][name], p, rtol=0, atol=tol)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--strategy=tp_pp", "--tp=3"], "4", "tp 3 x pp 1 does not fit 4 ranks"),
        (["--global_batch_size=6"], "4", "global batch 6 is not divisible by micro-batch 2 x dp 4"),
        (
            ["--strategy=ddp", "--tp=2"],
            "4",
            "--tp/--pp are for tp_pp, tp_sp, ep, megatron, fsdp2_tp, fsdp2_dtensor_tp",
        ),
        (["--strategy=tp_pp", "--ep=2"], "4", "--ep is for ep, not tp_pp"),
        (["--strategy=ddp", "--replicas=2"], "4", "--replicas is for fsdp2, not ddp"),
        (["--strategy=fsdp2_dtensor_tp", "--tp=4"], "4", "--tp=4 does not divide tiny's 2 heads"),
        (["--replicas=3"], "4", "--replicas=3 does not split 4 ranks into equal shard groups"),
        (["--strategy=ep", "--ep=2"], "4", "ep trains a mixture of experts; tiny is dense"),
        (
            ["--model=tiny-moe"],
            "2",
            "tiny-moe is a mixture of experts: train it with --strategy=ep",
        ),
        (["--strategy=ep", "--model=tiny-moe", "--ep=3"], "6", "4 experts do not split over ep 3"),
        (["--strategy=ep", "--model=tiny-moe", "--ep=4", "--tp=2"], "4", "ep 4 must divide dp 2"),
        (["--strategy=tp_sp", "--tp=2", "--pp=2"], "4", "tp_sp runs without a pipeline (pp = 1)"),
        (["--strategy=tp_sp"], "4", "tp_sp needs --tp > 1"),
        (["--strategy=zero3", "--recompute=full"], "2", "--recompute is not wired for DeepSpeed"),
        (["--recompute=some"], "2", "recompute"),
        (["--strategy=pipe"], "2", "unknown strategy 'pipe'"),
        (["--precision=fp16"], "2", "--precision=fp16 is declared by no strategy here"),
    ],
)
def test_bad_input_is_one_line(args, world, message, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(dtl_config.ConfigError) as err:
        dtl_config.load(train.Config, [*args, f"--out_dir={tmp_path}"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_model_that_does_not_fit_is_refused_before_allocation_with_what_fits():
    line = script_error(
        "day28_gpt125m.train",
        "--model=gpt2-124m",
        "--strategy=ddp",
        "--seq_len=1024",
        "--global_batch_size=16",
        env={"WORLD_SIZE": "8", "DTL_DEVICE_MEMORY_GB": "3"},
    )
    assert "gpt2-124m with ddp needs ~" in line and "the device has 3.0 GB" in line
    assert "strategies that fit: fsdp2" in line
    state_gb = float(re.search(r"needs ~[\d.]+ GB per rank \(state ([\d.]+)", line).group(1))
    assert state_gb == pytest.approx(num_params(preset("gpt2-124m")) * 16 / 1e9, abs=0.05)  # 16Ψ


LAUNCH = os.path.join(os.path.dirname(train.__file__), "launch")


@pytest.mark.parametrize(
    "script, env, world",
    [
        ("train_2gpu.sh", {}, 2),
        ("train_8gpu.sh", {"STRATEGY": "tp_pp", "TP": "2", "PP": "2"}, 8),
        ("train_2node.sh", {"RDZV_HOST": "10.0.0.1"}, 16),
        ("slurm.sbatch", {"SLURM_NNODES": "2", "HEAD_NODE": "n0"}, 16),
        pytest.param("deepspeed.sh", {}, 16, marks=needs_extras("deepspeed")),  # its zero3
    ],
)
def test_launch_scripts_pass_flags_train_accepts_for_their_gpu_count(
    script, env, world, tmp_path, monkeypatch
):
    import shlex
    import subprocess

    out = subprocess.run(
        ["bash", os.path.join(LAUNCH, script)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DRY_RUN": "1", **env},
    ).stdout
    *before, launch_line = out.strip().splitlines()
    words = shlex.split(launch_line)
    if script in ("train_2node.sh", "slurm.sbatch"):  # the preflight first, at the same endpoint
        preflight = shlex.split(before[-1])
        assert "dtl.preflight" in preflight
        endpoint = preflight[preflight.index("--endpoint") + 1]
        assert endpoint == words[words.index("--rdzv_endpoint") + 1]
    if words[0] == "deepspeed":  # the script by path, --local_rank added by the launcher
        args = words[words.index("day28_gpt125m/train.py") + 1 :] + ["--local_rank=0"]
    else:
        assert "torchrun" in words and words[words.index("-m") + 1] == "day28_gpt125m.train"
        assert "--node_rank" not in words  # c10d numbers the nodes; torchrun ignores it there
        args = words[words.index("-m") + 2 :]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("DTL_DEVICE_MEMORY_GB", "80")  # the GPUs the scripts are written for
    cfg = dtl_config.load(train.Config, [*args, f"--out_dir={tmp_path}"])
    assert cfg.model == "gpt2-124m" and cfg.global_batch_size * cfg.seq_len == 524_288


def test_device_memory_is_ram_for_a_gloo_run_on_a_gpu_machine(monkeypatch):
    monkeypatch.delenv("DTL_DEVICE_MEMORY_GB", raising=False)
    monkeypatch.delenv("DTL_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert fit.device_bytes(2) == ram / 2


def test_tensor_parallel_strategies_pad_the_vocabulary():
    padded = train.Config(strategy="tp_pp", model="gpt2-124m", tp=2, pp=2).model_config()
    assert padded.vocab_size % 256 == 0 and 50257 <= padded.vocab_size < 50257 + 256
    assert train.Config(strategy="fsdp2", model="gpt2-124m").model_config() == preset("gpt2-124m")
    assert train.Config(strategy="tp_pp", model="tiny", tp=2).model_config() == preset("tiny")
    # small's 50,304 rows split over tp 2 already: its tp_pp runs train the model ddp trains
    assert train.Config(strategy="tp_pp", model="small", tp=2).model_config() == preset("small")


def test_generate_never_draws_a_padded_row():
    from day28_gpt125m.recipe import generate
    from dtl.data import ByteTokenizer
    from dtl.model import GPT

    gpt = GPT(preset("tiny", vocab_size=384), seed=0)
    with torch.no_grad():
        gpt.lm_head.weight[256:] += 100.0
    assert generate(gpt, ByteTokenizer(), "ab", 8).startswith("ab")
