"""Day 22: what a layout costs one rank, by formula: parameters, state bytes, bytes sent per step
along each axis, and the pipeline bubble. train_megatron.py, train_4d.py and sweep.py print these
beside what they measure; the pieces come from the days that taught them.

Per rank, fp32 (e = 4 bytes), a step of m micro-batches of b sequences of s tokens, C = n_embd,
L layers over pp stages, V the vocabulary, t = tp, n = dp x cp:

    parameters    L/pp blocks of day 19's TP shard (block_params), + V·C/t + s_max·C on the
                  first stage (wte, wpe), + the final LayerNorm and (tied, pp > 1) a copy of
                  the V·C/t output layer on the last stage
    state         params e·P, grads e·P, Adam's m and v 2e·P (divided by n with Megatron's
                  distributed optimizer, which shards them over the data-parallel ranks)
    tp            day 19: per micro-batch, 4 all-reduces of b·s·C per block (2 for an MoE block:
                  its experts are whole on every TP rank), 1 for the embedding
                  (first stage), 1 for the output layer and 3·b·s numbers for the loss (last),
                  each 2(t-1)/t of the message per rank
    cp            day 21: ring attention, per layer and micro-batch (ring_layer_bytes)
    pp            day 20: per micro-batch one (b, s, C) activation to the next stage and one
                  gradient back, for each of this rank's v chunks that has a neighbour; plus the
                  tied embedding's gradient all-reduced between the first and last stage
    dp            the gradients all-reduced over dp x cp: 2(n-1)/n · e·P; under expert
                  parallelism (ep of the dp ranks) an expert's over its dp/ep x cp copies
    ep            per MoE layer and micro-batch, 4 all-to-alls of rows (2 forward, 2 backward):
                  each moves the rows this rank sends and the rows it receives once, so
                  2 (sent + received) · C · e, and one of the E token counts (int64) forward
    bubble        (p-1)/(v·m + p-1) of the step (day 20's bubble_formula)
    activations   L x 34·s·b·C/t bytes (Korthikanti et al. 2022: 16-bit, SP, no stored scores;
                  doubled in fp32): 1F1B's first stage holds p micro-batches of L/p layers, so
                  p cancels; + the fp32 logits and their gradient, 8·b·s·V/t (last stage)
"""

from __future__ import annotations

from day19_tp.formulas import block_params, ring_bytes
from day20_pp.schedules import bubble_formula
from day21_sp_cp import formulas as sp_cp
from day22_megatron.layouts import Layout
from dtl.exercise_seam import exercise
from dtl.model import GPTConfig
from dtl.precision import PRECISIONS

FP32 = 4
ADAM_STATES = 2  # m and v, fp32


def _ends(lay: Layout, pp_rank: int) -> tuple[bool, bool]:
    return pp_rank == 0, pp_rank == lay.pp - 1


@exercise("day22.params_per_rank")
def params_per_rank(cfg: GPTConfig, lay: Layout, pp_rank: int) -> int:
    """Parameters one rank holds (stage pp_rank's layers, its TP shard): the same on every TP
    and DP rank of the stage. Every stage holds n_layer / pp blocks, each as day 19's TP shard
    (block_params); the ends hold the rest of the model, the vocabulary split over the TP ranks
    (wte and the output layer are vocab-parallel; wpe and the LayerNorms are replicated)."""
    C, t = cfg.n_embd, lay.tp
    first, last = _ends(lay, pp_rank)
    # exercise day22.params_per_rank: begin
    n = cfg.n_layer // lay.pp * block_params(cfg, t, lay.ep)
    vocab = cfg.vocab_size * C // t
    if first:
        n += vocab + cfg.block_size * C  # wte (vocab-parallel) and wpe
    if last:
        n += C * (1 + int(cfg.bias))  # ln_f
        if not cfg.tie_weights or lay.pp > 1:
            n += vocab  # an output layer of its own (or the last stage's copy of wte)
    return n
    # exercise day22.params_per_rank: end


def expert_params(cfg: GPTConfig, lay: Layout, pp_rank: int) -> int:
    """The experts' share of params_per_rank: E/ep experts in each of the stage's layers."""
    if cfg.moe is None:
        return 0
    C, per_rank = cfg.n_embd, cfg.moe.n_expert // lay.ep
    experts = cfg.moe.layer_params(C, cfg.bias, per_rank) - cfg.moe.layer_params(C, cfg.bias, 0)
    return cfg.n_layer // lay.pp * experts


def ep_bytes(cfg: GPTConfig, rows_sent: int, rows_received: int, calls: int) -> float:
    """The all-to-all bytes (the data of each call, S) of `calls` MoE layer forwards that sent
    and received these rows in all: 2 (sent + received) C e, and E int64 counts per call."""
    assert cfg.moe is not None
    return 2 * (rows_sent + rows_received) * cfg.n_embd * FP32 + calls * cfg.moe.n_expert * 8


def state_bytes(
    cfg: GPTConfig,
    lay: Layout,
    pp_rank: int,
    distributed_optimizer: bool = False,
    padding: int = 0,
) -> dict[str, float]:
    """params / grads / optimizer bytes on one rank, fp32 training with Adam. With the
    distributed optimizer (ZeRO-1) Adam's m and v are sliced over dp x cp, and the weights and
    gradients live in flat buffers; `padding`: the elements those add to reach multiples of
    dp x cp (fewer than dp x cp per buffer)."""
    P = params_per_rank(cfg, lay, pp_rank) + padding
    shards = lay.dp * lay.cp if distributed_optimizer else 1
    return {
        "params": FP32 * P,
        "grads": FP32 * P,
        "optim": ADAM_STATES * FP32 * P / shards,
    }


def comm_bytes(
    cfg: GPTConfig,
    lay: Layout,
    pp_rank: int,
    *,
    micro_batch_size: int,
    microbatches: int,
    seq_len: int,
    sp: bool = False,
    distributed_optimizer: bool = False,
    padding: int = 0,
) -> dict[str, float]:
    """Bytes one rank sends in one training step along each axis (ring-equivalent: what a
    bandwidth-optimal ring sends per rank, as dtl.comm.CommCounter.ring_bytes_per_rank). With
    the distributed optimizer the gradients are reduce-scattered and the weights all-gathered,
    `padding` included: the all-reduce's bytes again; its norm is all-reduced over every rank."""
    b, m, C, e = micro_batch_size, microbatches, cfg.n_embd, FP32
    s_rank = seq_len // lay.cp  # the tokens of one row this rank holds
    tok = b * s_rank
    first, last = _ends(lay, pp_rank)
    layers = cfg.n_layer // lay.pp
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0, "norm": 0.0}
    if lay.tp > 1 and sp:  # day 21: SP's all-gathers and reduce-scatters, per micro-batch
        out["tp"] = m * sum(sp_cp.sp_step_bytes(cfg, b, s_rank, lay.tp, e).values())
    elif lay.tp > 1:  # 2 all-reduces (g forward, f backward) per split sublayer: attention,
        # and the MLP unless it is an MoE (its experts are not in the TP plan)
        sublayers = 1 if cfg.moe is not None else 2
        per_block = 2 * sublayers * tok * C
        elements = layers * per_block + first * tok * C + last * (tok * C + 3 * tok)
        out["tp"] = ring_bytes(m * elements, e, lay.tp)
    if lay.cp > 1:
        per_layer = sp_cp.ring_layer_bytes(b, seq_len, C, lay.cp, lay.tp, e)
        out["cp"] = m * layers * sum(per_layer.values())
    if lay.pp > 1:
        sends = 2 * lay.vpp - first - last  # activations forward and gradients back
        out["pp"] = sends * m * tok * C * e
        if cfg.tie_weights and (first or last):  # wte and its copy: all-reduce over 2 ranks
            out["pp"] += ring_bytes(cfg.vocab_size * C // lay.tp, e, 2)
    experts = expert_params(cfg, lay, pp_rank)  # averaged over their copies only
    dense = params_per_rank(cfg, lay, pp_rank) - experts
    out["dp"] = ring_bytes(dense + padding, e, lay.dp * lay.cp) + ring_bytes(
        experts, e, lay.dp // lay.ep * lay.cp
    )  # ZeRO-1: reduce-scatter + all-gather = 2 (d-1)/d, the all-reduce's ring bytes
    # clipping: the squared norm's shares, one fp64 scalar all-reduced over tp x pp (x ep:
    # other experts); over every rank under ZeRO-1, whose dp ranks hold other slices
    norm_ranks = lay.world if distributed_optimizer else lay.tp * lay.pp * lay.ep
    out["norm"] = ring_bytes(1, 8, norm_ranks)
    return out


def activation_bytes(
    cfg: GPTConfig, seq_len: int, micro: int, tp: int, precision: str = "bf16"
) -> float:
    """The activations one GPU holds at its peak (the module docstring's count; day 28's fit.py
    and day 22's plan.py both predict with it). An upper bound per rank with pp > 1: the layers'
    share peaks on the first stage, the logits on the last."""
    per_element = PRECISIONS[precision].activation / 2  # the 34 counts 2-byte activations
    layers = cfg.n_layer * 34 * seq_len * micro * cfg.n_embd * per_element / tp
    return layers + 8 * micro * seq_len * cfg.vocab_size / tp


def bubble(lay: Layout, microbatches: int) -> float:
    """The idle fraction of a step: (p-1)/(v·m + p-1); 0 without pipelining."""
    if lay.pp == 1:
        return 0.0
    name = "interleaved" if lay.vpp > 1 else "1f1b"
    return bubble_formula(name, lay.pp, microbatches, lay.vpp)


def micro_batches(tokens: int, seq_len: int, b: int, dp: int) -> tuple[int, int]:
    """(micro-batch, micro-batches per DP rank) of a step of `tokens` over `dp` data-parallel
    ranks: the micro-batch halved until the dp ranks' share divides into whole ones (many DP
    ranks: a smaller micro-batch fills them). The caller checks tokens % (seq_len·dp) == 0."""
    while b > 1 and tokens % (seq_len * b * dp):
        b //= 2
    return b, tokens // (seq_len * b * dp)
