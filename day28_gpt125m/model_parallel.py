"""Day 28: the course's own model parallelism as strategies, on day 22's stack.

    tp_pp   TP over grid.tp_group (day 19) -> the pipeline over grid.pp_group (day 20), DP beside
            by average_gradients; torch's AdamW
    tp_sp   Megatron sequence parallelism on TP (day 21), pp = 1; DP beside
    ep      an MoE GPT: its experts over grid.ep_group, ep of the dp ranks (day 22's ep.py,
            tokens by all-to-all); TP, PP and DP beside

`Pipelined` is what every TP x PP x DP strategy shares, megatron-core's too (megatron_core.py):
each pipeline stage's state by day 22's formulas, the fullest stage the one fit.py sizes by.
Checkpoints: day 24's Checkpointer over the stack (every TP shard a DTensor, the stages' keys
merged), which loads at another tp, pp or dp (day24_checkpoint/sharded.py).
"""

from __future__ import annotations

from day22_megatron import formulas, stack
from day22_megatron.layouts import Layout
from day24_checkpoint.ckpt import Checkpointer, Progress
from day24_checkpoint.sharded import StackState
from day28_gpt125m.strategy import Setup, Strategy, register
from dtl import profile as dtl_profile
from dtl.model import GPTConfig
from dtl.optim import set_lr


def stage_state(m: GPTConfig, lay: Layout, pp_rank: int, distopt: bool) -> float:
    """Day 22's formulas.state_bytes of pipeline stage `pp_rank` (the TP shard of its layers,
    E/ep experts of each MoE layer, the embedding on the first stage, the head on the last)."""
    return sum(formulas.state_bytes(m, lay, pp_rank, distopt).values())


def fullest_stage(m: GPTConfig, lay: Layout, distopt: bool) -> float:
    """The stage that holds the most: what every rank must have room for."""
    return max(stage_state(m, lay, r, distopt) for r in range(lay.pp))


def untied(state: dict, cfg: GPTConfig) -> dict:
    """A state dict keyed as named_parameters(): a tied lm_head.weight is wte.weight's name."""
    if cfg.tie_weights:
        state.pop("lm_head.weight", None)
    return state


class Pipelined(Strategy):
    """TP x PP x DP: each stage's state by day 22's formulas (the first stage holds the
    embedding, the last the head); `distributed_optimizer`: Adam's m and v sharded over dp."""

    model_parallel = True
    distributed_optimizer = False

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        lay = Layout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
        return fullest_stage(m, lay, distopt=cls.distributed_optimizer), 0.0

    @classmethod
    def predicted_rank_state(
        cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, pp_rank=0, precision="fp32"
    ):
        lay = Layout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
        return stage_state(m, lay, pp_rank, distopt=cls.distributed_optimizer)


@register
class OurTPPP(Pipelined):
    """Day 22's stack: TP over grid.tp_group, the pipeline over grid.pp_group, DP beside."""

    name = "tp_pp"

    def __init__(self, s: Setup):
        self.r = s.recipe
        self.stack = stack.build_stack(
            s.cfg,
            s.grid,
            micro_batch_size=s.micro_batch,
            microbatches=s.accum,
            seq_len=s.seq_len,
            seed=s.seed,
            optim=s.recipe.optim,
            device=s.device,
            sp=self.sequence_parallel,
            recompute=s.recompute,
        )

    def step(self, micro_batches, lr):
        loss = stack.forward_backward(self.stack, micro_batches)
        stack.sync_gradients(self.stack)
        norm = stack.clip_gradients(self.stack, self.r.clip or None)
        set_lr(self.stack.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.stack.optimizer.step()
        if self.measure_state:
            self.last_state = stack.stack_state_bytes(self.stack)
        self.stack.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def _app(self, step: int = 0) -> StackState:
        return StackState(self.stack, Progress(step=step))

    def save(self, folder, step):
        # day 24: DCP, every TP shard a DTensor, the stages' keys merged, an atomic commit:
        # it loads at another tp, pp or dp (day24_checkpoint/sharded.py)
        Checkpointer(folder, keep=2).save(self._app(step), step)

    def load(self, folder):
        return Checkpointer(folder, keep=2).load(self._app())

    def full_parameters(self):
        return untied(stack.full_state(self.stack), self.stack.gpt.cfg)


@register
class OurTPSP(OurTPPP):
    """Day 21's Megatron sequence parallelism on day 19's TP (day 22's stack with sp, pp = 1):
    the activations TP keeps whole (LayerNorms, dropout, residuals) split over the TP group,
    all-gather before each column layer, reduce-scatter after each row layer; DP beside. The
    same parameters and state per rank as TP alone: SP saves activations, not model state."""

    name = "tp_sp"
    sequence_parallel = True
    pipelines = False  # the stack runs SP without PP (stack.py says why)


@register
class OurEP(OurTPPP):
    """Day 22's stack on a mixture-of-experts GPT: the grid's ep axis inside dp (megatron-core's
    order), each MoE layer keeping its E/ep experts and sending tokens to them by all-to-all
    (day 22's ep.py); a dense gradient averaged over dp x ep, an expert's summed over its
    copies and divided by dp x ep (every rank's tokens reached it); TP and PP as tp_pp. The
    same Checkpointer: each expert a key of its own, so a checkpoint loads at another ep."""

    name = "ep"
    experts = True
