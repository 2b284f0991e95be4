"""Day 28: FSDP2 over DTensor tensor parallelism, torchtitan's composition as torchtitan writes it.

    fsdp2_dtensor_tp   parallelize_module on the tp dimension of the grid's DeviceMesh (torch's
                       ColwiseParallel / RowwiseParallel on each block's four matrices), then
                       fully_shard per block and on the root over its dp dimension: every matrix a
                       2-D DTensor, Shard(0) over dp on top of its TP placement

Where fsdp2_tp (sharded_tp.py) runs the course's own TP layers as plain tensors, here the TP
layers are torch's and every parameter is a DTensor that knows its placements. Three things follow:

- the fused QKV. DTensor's Shard(0) cuts rows contiguously; c_attn's one-process rows [Q; K; V]
  would give rank 0 all of Q's first half and none of V. The rows are laid out per head first,
  [q_0; k_0; v_0; q_1; ...] (Megatron's layout, dtl.tp_plan.per_head_rows), and the attention
  reads them so (dtl.model.qkv_per_head): any contiguous cut at whole heads is then a TP rank's
  heads, at every tp, so a checkpoint reshards to any tp that divides the heads.
- what stays whole over tp: wte (tied to the head), wpe and the LayerNorms are plain tensors that
  FSDP2 shards over dp only; each TP rank computes the full logits and the plain loss (no loss
  parallel: the tied embedding would need the vocab-parallel pair of day 19).
- the gradient norm: each parameter's placements say where it is split. A DTensor over the tp
  dimension is counted on every rank (its own piece); one over dp only is the same on every TP
  rank, counted on tp rank 0; the squares are all-reduced over the world.

Per rank, fp32: 16 P/dp bytes at rest, P = the blocks' TP shards plus the whole embeddings and
LayerNorms (dtensor_params_per_rank), and one block's TP shard gathered while it runs.
Checkpoints: day 24's Checkpointer over the DTensors themselves (DCP writes each piece once and
reshards on load), in the per-head row order.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from day19_tp.formulas import block_params
from day24_checkpoint.ckpt import AppState, Checkpointer, Progress
from day28_gpt125m.recipe import make_adamw
from day28_gpt125m.strategy import Setup, Strategy, register
from dtl import profile as dtl_profile
from dtl.dist import clip_by_pieces
from dtl.model import GPT, GPTConfig, loss_fn, qkv_per_head
from dtl.optim import set_lr
from dtl.simulate import item, to_device
from dtl.state import live_state_bytes
from dtl.tp_plan import per_head_rows

FP32_STATE = 16  # bytes per parameter held: fp32 weight, gradient, Adam m and v
PER_HEAD = ("attn.c_attn.weight", "attn.c_attn.bias")  # the tensors whose rows are per head

# torch's styles on each block's matrices (the course's TP_PLAN, its block part, as DTensor does
# it): a column split's output stays sharded into the row split, whose partial sums are
# all-reduced (Partial -> Replicate)
BLOCK_PLAN: dict[str, ParallelStyle] = {
    "attn.c_attn": ColwiseParallel(),
    "attn.c_proj": RowwiseParallel(),
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(),
}


def dtensor_params_per_rank(m: GPTConfig, tp: int) -> int:
    """The parameters a TP rank holds before FSDP: each block's TP shard, and the rest whole."""
    blocks = m.n_layer * block_params(m, tp)
    rest = m.vocab_size * m.n_embd + m.block_size * m.n_embd + m.n_embd * (1 + int(m.bias))
    return blocks + rest + (0 if m.tie_weights else m.vocab_size * m.n_embd)


def split_over_tp(p: DTensor) -> bool:
    """Does this parameter's placement cut it over the mesh's tp dimension?"""
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(p.placements[names.index("tp")], Shard)


def qkv_per_head_rows(gpt: GPT) -> None:
    """Every block's c_attn rows (and bias) reordered per head, read so by its attention."""
    rows = per_head_rows(gpt.cfg.n_head, gpt.cfg.head_dim)
    with torch.no_grad():
        for block in gpt.blocks.values():  # type: ignore[operator]
            c_attn = block.attn.c_attn
            c_attn.weight.copy_(c_attn.weight[rows])
            if c_attn.bias is not None:
                c_attn.bias.copy_(c_attn.bias[rows])
            block.attn.split_qkv = qkv_per_head


@register
class FSDP2DTensorTP(Strategy):
    """FSDP2 over dp on torch's DTensor TP over tp: a (dp, tp) mesh, every matrix a 2-D DTensor."""

    name = "fsdp2_dtensor_tp"
    model_parallel = True
    pipelines = False  # a (dp, tp) mesh: no pipeline here
    no_recompute = "--recompute is not checked with fsdp2_dtensor_tp here; use tp_pp or fsdp2"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        dp = world // tp
        return FP32_STATE * dtensor_params_per_rank(m, tp) / dp, 4 * block_params(m, tp)

    def __init__(self, s: Setup):
        self.r, self.grid = s.recipe, s.grid
        gpt = to_device(GPT(s.cfg, seed=s.seed), s.device)
        qkv_per_head_rows(gpt)  # before the split: a contiguous cut is then whole heads
        mesh = s.grid.device_mesh(s.device.type)  # (pp, dp, cp, tp): one root for both dims
        for block in gpt.blocks.values():  # type: ignore[operator]
            parallelize_module(block, mesh["tp"], BLOCK_PLAN)  # its matrices: DTensors over tp
        for block in gpt.blocks.values():  # type: ignore[operator]
            fully_shard(block, mesh=mesh["dp"])  # each block its own all-gather unit over dp
        self.gpt = fully_shard(gpt, mesh=mesh["dp"])
        self.optimizer = make_adamw(self.gpt, s.recipe)
        # a parameter split over tp counts its piece on every rank; one whole over tp (a
        # DTensor over dp only, or Replicate on tp: a row split's bias) is the same on every TP
        # rank: tp rank 0 counts it
        self.counted = [p for p in self.gpt.parameters() if split_over_tp(p) or s.grid.tp_rank == 0]

    def step(self, micro_batches, lr: float) -> tuple[float | None, float]:
        total, k = 0.0, len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            self.gpt.set_requires_gradient_sync(i == k - 1)  # reduce-scatter at the end
            with dtl_profile.range(dtl_profile.FORWARD):
                loss = loss_fn(self.gpt(x), y) / k  # the full logits on every TP rank
            with dtl_profile.range(dtl_profile.BACKWARD):
                loss.backward()
            total += item(loss)
        norm = clip_by_pieces(self.gpt.parameters(), self.counted, self.r.clip or None)
        set_lr(self.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.optimizer.step()  # AdamW on this rank's (dp, tp) piece of each parameter
        if self.measure_state:
            self.last_state = live_state_bytes(
                self.gpt.parameters(), self.optimizer, counters=False
            )
        self.optimizer.zero_grad(set_to_none=True)
        return total, norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered over dp and tp, c_attn's rows back in [Q; K; V] order."""
        back = per_head_rows(self.gpt.cfg.n_head, self.gpt.cfg.head_dim).argsort()
        out = {}
        for name, p in self.gpt.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if name.endswith(PER_HEAD):
                full = full[back]
            out[name] = full.detach().float().cpu().clone()
        return out

    def _app(self, step: int = 0) -> AppState:
        return AppState(self.gpt, self.optimizer, progress=Progress(step=step))

    def save(self, folder: str, step: int) -> None:
        Checkpointer(folder, keep=2).save(self._app(step), step)  # DCP over the 2-D DTensors

    def load(self, folder: str) -> int:
        return Checkpointer(folder, keep=2).load(self._app())
