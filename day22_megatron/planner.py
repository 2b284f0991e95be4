"""Day 22: choosing TP, PP and DP for a model and a cluster, worked by formula (no GPU needed).
The script plan.py prints it; day 22's scale.py, day 23's explainer and day 28's compare.py use
it as a library.

For every (tp, pp, dp) of the cluster, per GPU, in Megatron's recommended setting (bf16 params,
fp32 gradients, the distributed optimizer, sequence parallelism with TP, flash attention, 1F1B):

    model states  params_per_rank x (6 + 12/dp) bytes: bf16 param 2 + fp32 grad 4 + fp32
                  master, m, v 12 sharded over dp (Megatron-LM, docs: distributed optimizer);
                  18 without it (--distributed_optimizer=false)
    activations   L x 34·s·b·h/t (Korthikanti et al. 2022 with SP and no stored scores): the
                  first stage of 1F1B holds p micro-batches of L/p layers; + the last stage's
                  fp32 logits and their gradient 8·b·s·V/t (formulas.activation_bytes)
    TP traffic    per micro-batch 8(t-1)/t x (L/p)·s·b·h x 2 bytes, over NVLink when t <= 8
    PP traffic    per micro-batch one (s, b, h) bf16 activation and one gradient per boundary
    DP traffic    reduce-scatter fp32 grads + all-gather bf16 params: 6(d-1)/d x params_per_rank
    bubble        (p-1)/(m+p-1)
A layout fits when its memory is at most gpu_memory_gb x usable_memory_fraction (the CUDA
context, NCCL buffers and the allocator's fragmentation take the rest: step_model.py sources the
default). The step-time estimate is step_model.StepModel, a model stated as one, its assumptions
on the command line (--mfu, --nvlink_gbs, --ib_gbs, --overlap_fraction): compute at an assumed
MFU, stretched by the bubble, plus TP and PP traffic at link bandwidth (on the critical path),
plus the DP traffic not hidden behind compute. The formulas it uses (params_per_rank, bytes per
axis, activations per layer, the bubble) are the ones days 19-22 measure on CPU against real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from day22_megatron import formulas
from day22_megatron.layouts import Layout
from day22_megatron.step_model import GB, ClusterConfig, StepModel
from dtl import config as dtl_config
from dtl.model import PRESETS, GPTConfig, flops_per_token

BF16 = 2
MODELS = {
    "gpt2-124m": PRESETS["gpt2-124m"],
    # Llama-2-7B's shape (32 layers, 4096 wide, 32 heads, 32,000 tokens, s 4096) with the
    # course GPT's blocks (GELU MLP of 4h, learned positions): 6.6 B parameters
    "gpt-6.6b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000),
}


def check_models(models: str, tp: int = 1) -> None:
    """ConfigError (one line) unless every comma-separated name is in MODELS and `tp` divides
    each one's heads: what the scale scripts take before they build anything."""
    err = dtl_config.ConfigError
    names = models.split(",")
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise err(f"unknown model {unknown[0]!r}; one of {', '.join(MODELS)}")
    heads = {m: MODELS[m].n_head for m in names}
    if any(h % tp for h in heads.values()):
        raise err(f"--tp={tp} does not divide the heads of every model ({heads})")


@dataclass
class PlanConfig(ClusterConfig):  # + the cluster and step-model fields (step_model.ClusterConfig)
    global_batch_tokens: int = 0  # 0: 524,288 for gpt2-124m (llm.c), 4,194,304 for 6.6b (Llama 2)
    # 0: 16 for gpt2-124m, 1 for 6.6b (halved where dp needs it)
    micro_batch_size: Annotated[int, dtl_config.NON_NEGATIVE] = 0
    distributed_optimizer: bool = True  # false: 18 bytes per parameter on every DP rank


def defaults(model: str) -> tuple[int, int]:
    """(global batch tokens, micro-batch) the notes' worked examples use."""
    return (524_288, 16) if model == "gpt2-124m" else (4_194_304, 1)


def layouts_of(cfg: GPTConfig, gpus: int, per_node: int) -> list[Layout]:
    out = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= min(gpus, per_node) and gpus % t == 0):
        if cfg.n_head % tp:
            continue
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0):
            if cfg.n_layer % pp == 0 and pp <= cfg.n_layer:
                out.append(Layout(tp=tp, pp=pp, dp=gpus // (tp * pp)))
    return out


def evaluate(
    cfg: GPTConfig,
    lay: Layout,
    *,
    tokens: int,
    b: int,
    per_node: int,
    step: StepModel,
    distopt=True,
):
    """One layout's row: memory per GPU, bytes and seconds per step by axis, the estimate."""
    s, h, L, t, p, d = cfg.block_size, cfg.n_embd, cfg.n_layer, lay.tp, lay.pp, lay.dp
    b, m = formulas.micro_batches(tokens, s, b, d)  # m micro-batches per DP rank
    params = max(formulas.params_per_rank(cfg, lay, r) for r in range(p))
    states = params * (6 + 12 / d if distopt else 18)
    acts = formulas.activation_bytes(cfg, s, b, t)  # bf16 layers + fp32 logits and gradient
    tp_bytes = m * 8 * (t - 1) / t * (L / p) * s * b * h * BF16
    pp_bytes = m * 2 * s * b * h * BF16 if p > 1 else 0.0
    dp_bytes = 6 * (d - 1) / d * params
    dp_in_node = t * d <= per_node  # the dp group's ranks are t apart (TP innermost)
    pp_in_node = lay.world // p < per_node
    compute = step.compute_s(flops_per_token(cfg, s) * tokens / lay.world)
    bubble = formulas.bubble(lay, m)
    t_tp, t_pp, t_dp = (
        step.link_s(tp_bytes, True),
        step.link_s(pp_bytes, pp_in_node),
        step.link_s(dp_bytes, dp_in_node),
    )
    return dict(
        layout=lay.name(),
        b=b,
        m=m,
        memory_gb=(states + acts) / GB,
        states_gb=states / GB,
        acts_gb=acts / GB,
        tp_gb=tp_bytes / GB,
        pp_gb=pp_bytes / GB,
        dp_gb=dp_bytes / GB,
        tp_s=t_tp,
        pp_s=t_pp,
        dp_s=t_dp,
        dp_link="NVLink" if dp_in_node else "IB",
        bubble=bubble,
        compute_s=compute,
        step_s=step.step_s(compute, bubble, critical_s=t_tp + t_pp, overlappable_s=t_dp),
    )


def plan(
    cfg: GPTConfig,
    gpus: int,
    *,
    tokens: int,
    b: int,
    per_node: int,
    memory_gb: float,
    step: StepModel,
    distopt: bool = True,
):
    """Every layout's row, and the fastest of those that fit in `memory_gb` (the usable GB)."""
    rows = [
        evaluate(cfg, lay, tokens=tokens, b=b, per_node=per_node, step=step, distopt=distopt)
        for lay in layouts_of(cfg, gpus, per_node)
        if tokens % (cfg.block_size * lay.dp) == 0  # one sequence per DP rank at least
    ]
    fits = [r for r in rows if r["memory_gb"] <= memory_gb]
    best = min(fits, key=lambda r: r["step_s"]) if fits else None
    return rows, best


def show(name: str, gpus: int, rows, best, cluster: ClusterConfig) -> str:
    head = (
        f"{'layout':<14}{'b':>3}{'m':>5}{'mem GB':>8}{'states':>8}{'acts':>7}{'TP GB':>7}"
        f"{'PP GB':>7}{'DP GB':>7}{'DP on':>7}{'bubble':>7}{'compute s':>10}{'step s':>8}"
    )
    usable = cluster.usable_gb
    lines = [f"{name} on {gpus} GPUs ({cluster.gpu_memory_gb:.0f} GB each, {usable:.1f} usable):"]
    lines.append(head)
    for r in rows:
        mark = " <- pick" if r is best else ("" if r["memory_gb"] <= usable else "  (no fit)")
        lines.append(
            f"{r['layout']:<14}{r['b']:>3}{r['m']:>5}{r['memory_gb']:>8.1f}{r['states_gb']:>8.1f}"
            f"{r['acts_gb']:>7.1f}{r['tp_gb']:>7.1f}{r['pp_gb']:>7.2f}{r['dp_gb']:>7.1f}"
            f"{r['dp_link']:>7}{r['bubble']:>7.2f}{r['compute_s']:>10.2f}{r['step_s']:>8.2f}{mark}"
        )
    return "\n".join(lines)


def plan_for(cfg: PlanConfig, name: str, gpus: int):
    """(tokens per step, every layout's row, the pick) of model `name` on `gpus` GPUs as the
    command line asks: its batch, the usable memory, its step model."""
    tokens, b = defaults(name)
    tokens, b = cfg.global_batch_tokens or tokens, cfg.micro_batch_size or b
    rows, best = plan(
        MODELS[name],
        gpus,
        tokens=tokens,
        b=b,
        per_node=cfg.gpus_per_node,
        memory_gb=cfg.usable_gb,
        step=cfg.step_model(),
        distopt=cfg.distributed_optimizer,
    )
    return tokens, rows, best
