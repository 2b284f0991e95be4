"""Bad input to every script of days 18-28 stops it with one line on stderr, exit code 2, and no
process group created: four cases or more per script, each naming what is wrong. A script run
here is a fork of dtl.script_server's interpreter (torch imported once), as dtl.testing's
script_error runs it; WORLD_SIZE says what torchrun would have launched."""

from __future__ import annotations

import pytest

from dtl.testing import script_error

NOT_FOUND = "/nonexistent/ds.json"
CASES = {
    "day18_zero.train": [
        (["--stage=4"], "unknown ZeRO stage 4"),
        (["--bucket_cap_mb=0"], "'bucket_cap_mb' must be a finite number > 0"),  # once a ZeroError
        (["--grad_accum=0"], "'grad_accum' must be an integer >= 1"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
        (["--impl=deepspeed", f"--ds_config={NOT_FOUND}"], "ds_config file not found"),
        ([f"--ds_config={NOT_FOUND}"], "--ds_config is read by impl=deepspeed only; this run is"),
    ],
    "day18_zero.bench": [
        (["--pairs=zero5"], "unknown pair(s) ['zero5']"),
        (["--precision=fp16"], "hand ZeRO (stages 1-3) does not train in fp16"),
        (["--steps=2", "--warmup=2"], "steps (2) must exceed warmup (2)"),
        (["--seq_len=0"], "'seq_len' must be an integer >= 1"),
    ],
    "day18_zero.scale": [
        (["--models=gpt5"], "unknown model(s) ['gpt5']"),
        (["--ns=8,abc"], "ns must be comma-separated integers"),
        (["--engines=hand-4"], "unknown engine(s) ['hand-4']"),
        (["--precision=fp16"], "simulated ZeRO (hand stages 1-3, FSDP2) does not train in fp16"),
    ],
    "day22_megatron.scale": [
        (["--models=gpt5"], "unknown model(s) ['gpt5']"),
        (["--gpus=8,x"], "gpus must be comma-separated integers"),
        (["--micro_batches=-1"], "'micro_batches' must be an integer >= 0"),
        (["--gpus=0"], "gpus must be >= 1, got '0'"),
        (["--models=gpt-6.6b", "--gpus=1"], "plan.py finds no layout of gpt-6.6b that fits 1"),
    ],
    "day22_megatron.zero1_scale": [
        (["--models=gpt5"], "unknown model 'gpt5'"),
        (["--ranks=8,x"], "ranks must be comma-separated integers"),
        (["--ranks=6"], "ranks 6: a multiple of 4, at least 8"),
        (["--micro_batches=0"], "'micro_batches' must be an integer >= 1"),
        ([], "zero1_scale.py runs as one process (--nproc_per_node=1)"),
    ],
    "day22_megatron.hsdp_scale": [
        (["--models=gpt5"], "unknown model 'gpt5'"),
        (["--ranks=64,x"], "ranks must be comma-separated integers"),
        (["--ranks=12"], "ranks 12: a multiple of 8, two nodes or more"),
        (["--seq_len=0"], "'seq_len' must be an integer >= 1"),
        ([], "hsdp_scale.py runs as one process (--nproc_per_node=1)"),
    ],
    "day22_megatron.placement": [
        (["--models=gpt5"], "unknown model 'gpt5'"),
        (["--ranks=8,x"], "ranks must be comma-separated integers"),
        (["--ranks=6"], "ranks 6: a multiple of 2 x --tp = 4"),
        (["--tp=5"], "--tp=5 does not divide the heads of every model"),
        ([], "placement.py runs as one process (--nproc_per_node=1)"),
    ],
    "day22_megatron.train_hsdp": [
        (["--replicas=3"], "--replicas=3 does not split 4 ranks into equal shard groups"),
        (["--replicas=0"], "--replicas=0 does not split 4 ranks"),
        (["--global_batch_size=6"], "global batch 6 does not split over 4 ranks"),
        (["--model=nope"], "unknown model 'nope'"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
    ],
    "day22_megatron.moe_scale": [
        (["--models=gpt5"], "unknown model(s) ['gpt5']"),
        (["--ns=64,x"], "ns must be comma-separated integers"),
        (["--distributions=normal"], "unknown distribution(s) ['normal']"),
        (["--tokens=0"], "'tokens' must be an integer >= 1"),
        (["--models=deepseek-v3", "--ns=32"], "no ep of deepseek-v3's (64, 256) divides N = 32"),
        ([], "moe_scale.py runs as one process (--nproc_per_node=1)"),
    ],
    "day28_gpt125m.scale": [
        (["--models=gpt5"], "unknown model(s) ['gpt5']"),
        (["--gpus=8,x"], "gpus must be comma-separated integers"),
        (["--gpus=0"], "gpus must be >= 1"),
        (["--gpus=7"], "[7] GPUs do not share"),
    ],
    "day18_zero.memory": [
        (["--model=nope"], "unknown model 'nope'"),
        (["--batch_size=0"], "'batch_size' must be an integer >= 1"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
        (["--out_dir=/proc/nope"], "out_dir '/proc/nope' is not a writable folder"),
    ],
    "day19_tp.train": [
        (["--tp=0"], "'tp' must be an integer >= 1"),
        (["--tp=3"], "tp 3 does not divide the world size 4"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
        (["--lr=0"], "'lr' must be a finite number > 0"),
    ],
    "day19_tp.bench": [
        (["--part=x"], "unknown part 'x'"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),  # once a traceback
        (["--model=nope"], "unknown model 'nope'"),
    ],
    "day19_tp.layout": [
        (["--tp=3"], "n_head 4 must divide by tp 3"),
        (["--n_head=3"], "n_head 3 must divide by tp 2"),
        (["--n_embd=0"], "'n_embd' must be an integer >= 1"),
        (["--tp=0"], "'tp' must be an integer >= 1"),
    ],
    "day20_pp.train": [
        (["--schedule=x"], "unknown schedule 'x'"),
        (["--pp=0"], "'pp' must be an integer >= 1"),
        (["--pp=3"], "pp 3 does not divide the world size 4"),
        (["--microbatches=0"], "'microbatches' must be an integer >= 1"),
        (["--chunks=0"], "'chunks' must be an integer >= 1"),
        (["--schedule=dualpipev", "--pp=2", "--microbatches=3"], "DualPipe-V needs m >= 2p"),
    ],
    "day20_pp.bench": [
        (["--part=x"], "unknown part 'x'"),
        (["--t_f_ms=0"], "'t_f_ms' must be a finite number > 0"),
        (["--microbatches=0"], "'microbatches' must be an integer >= 1"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
        (["--pps=4", "--microbatches=4"], "dualpipev at p = 4: DualPipe-V needs m >= 2p"),
    ],
    "day21_sp_cp.train": [
        (["--cp=0"], "'cp' must be an integer >= 1"),  # once a ZeroDivisionError
        (["--attn=x"], "unknown attention 'x'"),
        (["--seq_len=127"], "seq_len 127 is not divisible by 4"),
        (["--sp=true"], "--sp needs tensor parallelism"),
    ],
    "day21_sp_cp.bench": [
        (["--part=x"], "unknown part 'x'"),
        (["--heads=0"], "'heads' must be an integer >= 1"),
        (["--seqs=abc"], "seqs must be comma-separated integers"),
        (["--reps=0"], "'reps' must be an integer >= 1"),
    ],
    "day22_megatron.plan": [
        (["--model=x"], "unknown model 'x'"),
        (["--mfu=2"], "'mfu' must be a finite number > 0 and <= 1"),
        (["--gpus=-1"], "'gpus' must be an integer >= 0"),
        (["--micro_batch_size=-1"], "'micro_batch_size' must be an integer >= 0"),
        (["--usable_memory_fraction=0"], "'usable_memory_fraction' must be a finite number > 0"),
        (["--ib_gbs=0"], "'ib_gbs' must be a finite number > 0"),
    ],
    "day22_megatron.sweep": [
        (["--part=x"], "unknown part 'x'"),
        (["--tp=0"], "'tp' must be an integer >= 1"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
        (["--memory_budget_mb=-1"], "'memory_budget_mb' must be a finite number >= 0"),
    ],
    "day22_megatron.train_4d": [
        (["--num_layers=-1"], "'num_layers' must be an integer >= 0"),  # once a KeyError
        (["--cp=0"], "'cp' must be an integer >= 1"),
        (["--chunks=2"], "--chunks=2 needs --pp >= 2"),
        (["--attn=x"], "unknown attention 'x'"),
        (["--make_vocab_size_divisible_by=0"], "'make_vocab_size_divisible_by' must be an integer"),
        (["--ep=0"], "'ep' must be an integer >= 1"),
        (["--ep=2"], "ep 2 needs a model with experts (e.g. --model=tiny-moe)"),
        (["--model=tiny-moe", "--ep=3"], "ep 3 must divide dp 4: the expert ranks are dp ranks"),
        (["--model=tiny-moe", "--cp=2"], "an MoE runs without CP and SP here"),
        (["--model=tiny-moe", "--distributed_optimizer"], "--distributed_optimizer runs on dense"),
    ],
    "day22_megatron.train_megatron": [
        (["--precision=bf16"], "megatron-core trains bf16 on cuda only"),
        (["--tensor-model-parallel-size=0"], "'tensor_model_parallel_size' must be an integer"),
        (["--global-batch-size=7"], "global batch 7 is not divisible by micro-batch 1 x dp 4"),
        (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
        (["--adam_beta1=1.5"], "'adam_beta1' must be a finite number >= 0 and < 1"),
    ],
    "day23_zero3_offload.train": [
        ([f"--ds_config={NOT_FOUND}"], "ds_config file not found"),
        (["--precision=fp16"], "DeepSpeed trains fp16 on cuda only"),
        (["--resume"], "--save_at and --resume need --ckpt_dir"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
    ],
    "day23_zero3_offload.bench": [
        (["--part=x"], "unknown part 'x'"),
        (["--keys_model=abc"], "keys_model must be LAYERSxWIDTH"),
        (["--steps=1"], "steps must be >= 2"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
    ],
    "day23_zero3_offload.scale": [
        (["--model=x"], "unknown model 'x'"),
        (["--ns=8,x"], "ns must be comma-separated integers"),
        (["--ns=0"], "ns must be >= 1"),
        (["--fit_budget_gb=-1"], "'fit_budget_gb' must be a finite number >= 0"),
    ],
    "day23_zero3_offload.explain": [
        ([f"--ds_config={NOT_FOUND}"], "ds_config file not found"),
        (["--model=x"], "unknown model 'x'"),
        (["--world=0"], "'world' must be an integer >= 1"),
        (["--fit_budget_gb=-1"], "'fit_budget_gb' must be a finite number >= 0"),
    ],
    "day24_checkpoint.train": [
        (["--parallel=x"], "unknown parallel 'x'"),
        (["--keep=0"], "'keep' must be an integer >= 1"),
        (["--resume=maybe"], "resume 'maybe' is neither auto, none, latest nor a folder"),
        (["--global_batch=7"], "global_batch 7 does not split over 4 ranks"),
        (["--fail_rank=5"], "fail_rank 5 is not a rank of this run (ranks 0-3)"),
        (["--fail_at_step=2", "--fail_rank=-1"], "fail_rank -1 is not a rank of this run"),
    ],
    "day24_checkpoint.drill": [
        (["--drill=x"], "unknown drill 'x'"),
        (["--nproc=0"], "'nproc' must be an integer >= 1"),
        (["--backend=x"], "unknown backend 'x'"),
        (["--repeats=0"], "'repeats' must be an integer >= 1"),
    ],
    "day24_checkpoint.bench": [
        (["--models=x"], "unknown model 'x'"),
        (["--saves=0"], "'saves' must be an integer >= 1"),
        (["--seq_len=0"], "'seq_len' must be an integer >= 1"),
        (["--batch_size=0"], "'batch_size' must be an integer >= 1"),
    ],
    "day27_profiling.bench": [
        (["--part=x"], "unknown part 'x'"),
        (["--runs=x"], "unknown run 'x'"),
        (["--precision=fp64"], "unknown precision 'fp64'"),  # once a KeyError (--dtype)
        (["--seq_len=4096"], "seq_len 4096 exceeds small's block_size"),
    ],
    "day27_profiling.profile": [
        ([], "give either --target=<module> or --lesson=<day> --run="),
        (["--lesson=99"], "no lesson for day 99"),
        (["--lesson=20", "--run=nope"], "day 20 has no run 'nope'"),
        (["--lesson=20"], "day 20 has no run ''"),
    ],
    "day27_profiling.nsys": [  # (run here as rank of 4: the world-size check is one case)
        ([], "nsys.py runs as one process (--nproc_per_node=1)"),
        (["--lesson=abc"], "'lesson'"),
        (["--active_step=-1"], "'active_step' must be an integer >= 0"),
        (["--bogus=1"], "unknown config key 'bogus'"),
    ],
    "day28_gpt125m.train": [
        (["--data=/nonexistent.txt"], "text file not found: /nonexistent.txt"),  # once rank 0's
        (["--data=no_such_dataset_here"], "could not find dataset 'no_such_dataset_here'"),
        (["--workers=-1"], "'workers' must be an integer >= 0"),
        (["--clip=-1"], "'clip' must be a finite number >= 0"),  # once trained
        (["--lr=0.1", "--min_lr=1"], "min_lr 1 exceeds lr 0.1"),  # once trained, then failed
        (["--precision=fp16"], "--precision=fp16 is declared by no strategy here"),
    ],
    "day28_gpt125m.ablation": [
        (["--model=x"], "unknown model 'x'"),
        (["--only=x"], "unknown group(s) ['x']"),  # once an IndexError
        (["--precision=fp16"], "autocast (ddp, fsdp2, the ablation) does not train in fp16"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
    ],
    "day28_gpt125m.fp8": [
        (["--steps=0"], "'steps' must be an integer >= 1"),
        (["--seq_len=100000"], "seq_len 100000 exceeds small's block_size"),
        (["--model=nope"], "unknown model 'nope'"),
        (["--lr=-1"], "'lr' must be a finite number > 0"),
    ],
    "day28_gpt125m.bench_mfu": [
        (["--micro_batches=abc"], "micro_batches must be integers"),
        (["--steps=0"], "'steps' must be an integer >= 1"),
        (["--model=x"], "unknown model 'x'"),
        (["--seq_len=100000"], "seq_len 100000 exceeds gpt2-124m's block_size"),  # once skipped
    ],
    "day28_gpt125m.sharded_tp_scale": [
        (["--models=gpt5"], "unknown model 'gpt5'"),
        (["--ranks=64,x"], "ranks must be comma-separated integers"),
        (["--ranks=4"], "ranks 4: a multiple of --tp=4, with dp >= 2"),
        (["--tp=5"], "--tp=5 does not divide the heads of every model"),
        ([], "sharded_tp_scale.py runs as one process (--nproc_per_node=1)"),
    ],
    "day28_gpt125m.compare": [
        (["--models=x"], "unknown model(s) ['x']"),
        (["--gpus=abc"], "gpus must be comma-separated integers"),  # once a ValueError traceback
        (["--mfu=0"], "'mfu' must be a finite number > 0 and <= 1"),
        (["--gpus_per_node=0"], "'gpus_per_node' must be an integer >= 1"),
        (["--plot_gpus=12"], "plot_gpus: [12] GPUs do not share gpt3-125m's 256 sequences"),
        (["--overlap_fraction=2"], "'overlap_fraction' must be a fraction in [0, 1]"),
    ],
}
PARAMS = [
    pytest.param(module, args, message, id=f"{module}:{' '.join(args) or 'no-args'}")
    for module, cases in CASES.items()
    for args, message in cases
]


def test_every_script_of_days_18_to_28_has_four_cases_or_more():
    import importlib
    import pathlib

    root = pathlib.Path(__file__).parent.parent
    for day in sorted(root.glob("day*")):
        if not day.is_dir() or int(day.name[3:5]) < 18:
            continue
        for script in sorted(day.glob("*.py")):
            module = f"{day.name}.{script.stem}"
            if "\ndef main(" in script.read_text() and hasattr(
                importlib.import_module(module), "Config"
            ):
                assert len(CASES.get(module, ())) >= 4, f"{module}: fewer than 4 bad-input cases"


@pytest.mark.parametrize("module, args, message", PARAMS)
def test_bad_input_is_one_line_exit_2_before_any_process_group(module, args, message):
    line = script_error(module, *args, env={"WORLD_SIZE": "4"})  # exit 2, one line, no group
    assert line.startswith("error: ") and message in line, line
