"""The shared GPT as megatron-core's `GPTModel`, and a state-dict converter both ways.

    chunks = build_model_chunks(cfg, grid, vpp=2)    # this rank's model chunks
    load_dense(chunks, GPT(cfg).state_dict(), cfg, grid)  # every layout starts from one model
    dense = gather_dense(chunks, cfg, grid)           # and comes back as dtl names

Same network, other names and layouts (dtl.model -> megatron-core 0.16, local layer spec):

    wte.weight                    embedding.word_embeddings.weight    vocab-parallel (rows)
    wpe.weight                    embedding.position_embeddings.weight
    blocks.i.ln_1.{weight,bias}   decoder.layers.i.input_layernorm.*
    blocks.i.attn.c_attn.*        decoder.layers.i.self_attention.linear_qkv.*   column, per head
    blocks.i.attn.c_proj.*        decoder.layers.i.self_attention.linear_proj.*  row
    blocks.i.ln_2.*               decoder.layers.i.pre_mlp_layernorm.*
    blocks.i.mlp.c_fc.*           decoder.layers.i.mlp.linear_fc1.*              column
    blocks.i.mlp.c_proj.*         decoder.layers.i.mlp.linear_fc2.*              row
    ln_f.*                        decoder.final_layernorm.*
    lm_head.weight                output_layer.weight (tied: only on a last stage that has no wte)

Two things differ beyond the names:
- the fused QKV. Ours stacks [Q; K; V] (all heads of Q, then K, then V). Megatron interleaves by
  head group, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (attention.py, get_query_key_value_tensors:
  [sq, b, ng * (np/ng + 2) * hn]), so that a contiguous slice of rows is whole heads: a TP rank's
  shard is one `chunk` of the rows, and GQA groups stay together.
- layer numbers. A pipeline stage's `decoder.layers.0` is global layer `layer_number - 1`
  (1-based in megatron); we key on the global number, so a state dict means the same thing
  whatever the layout.
Megatron keeps activations as [s, b, h] (sequence first); its forward takes [b, s] token ids and
returns [b, s] per-token losses when given labels.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtl.megatron as dm
from dtl.grid import ParallelGrid
from dtl.model import GPTConfig

QKV = ("attn.c_attn.weight", "attn.c_attn.bias")

# dtl name inside a block -> megatron name inside a layer
LAYER_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_1.bias": "input_layernorm.bias",
    "attn.c_attn.weight": "self_attention.linear_qkv.weight",
    "attn.c_attn.bias": "self_attention.linear_qkv.bias",
    "attn.c_proj.weight": "self_attention.linear_proj.weight",
    "attn.c_proj.bias": "self_attention.linear_proj.bias",
    "ln_2.weight": "pre_mlp_layernorm.weight",
    "ln_2.bias": "pre_mlp_layernorm.bias",
    "mlp.c_fc.weight": "mlp.linear_fc1.weight",
    "mlp.c_fc.bias": "mlp.linear_fc1.bias",
    "mlp.c_proj.weight": "mlp.linear_fc2.weight",
    "mlp.c_proj.bias": "mlp.linear_fc2.bias",
}
TOP_NAMES = {
    "wte.weight": "embedding.word_embeddings.weight",
    "wpe.weight": "embedding.position_embeddings.weight",
    "ln_f.weight": "decoder.final_layernorm.weight",
    "ln_f.bias": "decoder.final_layernorm.bias",
    "lm_head.weight": "output_layer.weight",
}


class ConvertError(ValueError):
    """A state dict the converter cannot map; one line."""


# --- the converter: pure functions on full (unsharded, one-stage) state dicts -------------------


def _qkv_to_megatron(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """[Q; K; V] rows (3, nh, hs, ...) -> per-head [q_h; k_h; v_h] rows (nh, 3, hs, ...)."""
    rest = t.shape[1:]
    return t.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(t.shape).clone()


def _qkv_from_megatron(t: torch.Tensor, n_head: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(t.shape).clone()


def to_megatron(dense: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """dtl GPT state dict (one process) -> megatron GPTModel names and layouts, global layers.

    A tied lm_head is dropped (megatron's one-stage model has no output_layer.weight then)."""
    out = {}
    for name, t in dense.items():
        if name == "lm_head.weight" and cfg.tie_weights:
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m:
            layer, inner = m.groups()
            if inner not in LAYER_NAMES:
                raise ConvertError(f"to_megatron: no megatron name for {name}")
            if inner in QKV:
                t = _qkv_to_megatron(t, cfg.n_head)
            out[f"decoder.layers.{layer}.{LAYER_NAMES[inner]}"] = t.clone()
        elif name in TOP_NAMES:
            out[TOP_NAMES[name]] = t.clone()
        else:
            raise ConvertError(f"to_megatron: no megatron name for {name}")
    return out


def from_megatron(mstate: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_megatron`; a tied lm_head comes back as wte's tensor (one process
    lists both names for the one Parameter). `_extra_state` entries are skipped."""
    layer_back = {v: k for k, v in LAYER_NAMES.items()}
    top_back = {v: k for k, v in TOP_NAMES.items()}
    out = {}
    for name, t in mstate.items():
        if name.endswith("._extra_state"):
            continue
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m:
            layer, inner = m.groups()
            if inner not in layer_back:
                raise ConvertError(f"from_megatron: no dtl name for {name}")
            dense_inner = layer_back[inner]
            if dense_inner in QKV:
                t = _qkv_from_megatron(t, cfg.n_head)
            out[f"blocks.{layer}.{dense_inner}"] = t.clone()
        elif name in top_back:
            out[top_back[name]] = t.clone()
        else:
            raise ConvertError(f"from_megatron: no dtl name for {name}")
    if cfg.tie_weights and "wte.weight" in out:
        out.setdefault("lm_head.weight", out["wte.weight"])
    return out


# --- the model chunks of one rank ----------------------------------------------------------------


def transformer_config(
    cfg: GPTConfig, grid: ParallelGrid, *, sequence_parallel: bool = False, **overrides
):
    """megatron's TransformerConfig for the shared GPT's sizes and math.

    The math must be ours, not megatron's defaults: GELU with the tanh approximation (GPT-2's,
    megatron's default is exact erf), biases as the preset says, no dropout, LayerNorm eps 1e-5.
    The fusions are off (dtl.megatron.FUSIONS_OFF).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return dm.model_parallel_config(
        grid,
        config_class=TransformerConfig,
        num_layers=cfg.n_layer,
        hidden_size=cfg.n_embd,
        num_attention_heads=cfg.n_head,
        ffn_hidden_size=4 * cfg.n_embd,
        kv_channels=cfg.head_dim,
        add_bias_linear=cfg.bias,
        activation_func=_gelu_tanh,
        layernorm_epsilon=1e-5,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        **dm.FUSIONS_OFF,
        sequence_parallel=sequence_parallel,
        **overrides,
    )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm that megatron can run under sequence parallelism.

    The local spec's norm (WrappedTorchNorm) refuses SP outright; apex's and Transformer Engine's
    norms accept it, and all they add for it is a flag on their parameters: under SP each TP rank
    normalises other tokens, so its weight and bias gradients are partial sums that
    finalize_model_grads all-reduces over TP for every parameter marked `sequence_parallel`.
    This is that flag on torch's LayerNorm, so SP runs with no apex or TE on a CPU (tested); on a
    GPU without TE it should too (not run on a GPU)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def layer_spec(sequence_parallel: bool):
    """megatron-core's local GPT layer spec; under SP its norms become SequenceParallelLayerNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if sequence_parallel:
        spec.submodules.input_layernorm = SequenceParallelLayerNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return spec


def _block_spec(config, vp_stage):
    """The decoder's spec: this stage's layers and its final norm (built like megatron's
    `_get_block_submodules` does for a layer spec, but with our norm under SP)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = layer_spec(config.sequence_parallel)
    if not config.sequence_parallel:
        return spec
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=SequenceParallelLayerNorm)


def build_model_chunks(
    cfg: GPTConfig, grid: ParallelGrid, vpp: int | None = None, **config_overrides
):
    """This rank's GPTModel chunks: one, or `vpp` (virtual pipeline stages) for interleaving.

    Needs megatron's parallel_state (dtl.megatron.init_parallel_state) and, on a CPU, the shim.
    Chunk c of pipeline rank r holds virtual stage c·pp + r: megatron's interleaved layout, the
    same as day 20's (stage s lives on rank s % pp as its chunk s // pp)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        cfg,
        grid,
        virtual_pipeline_model_parallel_size=vpp,
        **config_overrides,
    )
    chunks = []
    for c in range(vpp or 1):
        vp = c if vpp else None
        chunks.append(
            GPTModel(
                config,
                _block_spec(config, vp),
                vocab_size=cfg.vocab_size,
                max_sequence_length=cfg.block_size,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=cfg.tie_weights,
                position_embedding_type="learned_absolute",
                vp_stage=vp,
            )
        )
    return chunks


def _global_name(chunk, local: str) -> str:
    """A chunk's local parameter name -> the name in the full (one-stage) megatron model."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", local)
    if not m:
        return local
    layer = chunk.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"


def _tp_slice(full: torch.Tensor, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a full tensor, by the attributes megatron sets on its params."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


@torch.no_grad()
def load_dense(chunks, dense: dict[str, torch.Tensor], cfg: GPTConfig, grid: ParallelGrid) -> None:
    """Copy a dtl GPT's state dict (one process) into this rank's chunks: its TP shard of the
    layers its pipeline stages hold. A last stage's own copy of a tied embedding gets wte too."""
    full = to_megatron(dense, cfg)
    if "output_layer.weight" not in full:  # tied: a last stage without wte holds a copy
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    for chunk in chunks:
        for local, p in chunk.named_parameters():
            name = _global_name(chunk, local)
            if name not in full:
                raise ConvertError(f"load_dense: the dense model has no {name}")
            piece = _tp_slice(full[name], p, grid.tp_rank, grid.tp_size)
            if piece.shape != p.shape:
                raise ConvertError(
                    f"load_dense: {name} is {tuple(piece.shape)} for this rank, the chunk "
                    f"holds {tuple(p.shape)}"
                )
            p.copy_(piece)


def local_full_tensors(chunks, grid: ParallelGrid, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's chunks as full-TP tensors under global megatron names (gathered over the TP
    group: collective on it). `grads` reads `main_grad` (megatron DDP) or `grad`."""
    out = {}
    for chunk in chunks:
        for local, p in chunk.named_parameters():
            t = p
            if grads:
                t = getattr(p, "main_grad", None)
                t = p.grad if t is None else t
            t = t.detach()
            if getattr(p, "tensor_model_parallel", False) and grid.tp_size > 1:
                pieces = [torch.empty_like(t) for _ in range(grid.tp_size)]
                dist.all_gather(pieces, t.contiguous(), group=grid.tp_group)
                t = torch.cat(pieces, dim=p.partition_dim)
            out[_global_name(chunk, local)] = t.cpu().clone()
    return out


def gather_dense(
    chunks, cfg: GPTConfig, grid: ParallelGrid, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The whole model (or its gradients) as a dtl GPT state dict, on every rank: TP shards
    all-gathered, then the pipeline stages' pieces all-gathered over the pp group. A last
    stage's copy of a tied embedding is dropped: wte, from the first stage, stands for both."""
    mine = local_full_tensors(chunks, grid, grads)
    if cfg.tie_weights:
        mine.pop("output_layer.weight", None)
    pieces: list = [None] * grid.pp_size
    dist.all_gather_object(pieces, mine, group=grid.pp_group)
    merged = {k: v for piece in pieces for k, v in piece.items()}
    return from_megatron(merged, cfg)
