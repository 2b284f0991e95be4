"""Day 22: the libraries' mixture-of-experts layers holding our layer's weights, side by side.

    layer = megatron_moe(ours)                 # megatron-core's MoELayer (parallel_state first)
    y, aux = megatron_forward(layer, x)        # inside dtl.megatron.cpu_shim() and moe_cpu_shim()
    layer = deepspeed_moe(ours, ep_size=2)     # DeepSpeed's MoE (deepspeed.comm up)
    y, l_aux, counts = layer(x)                # add coef * l_aux to the loss yourself

What each one calls what (ours: dtl/moe.py):

    ours                     megatron-core 0.16                        DeepSpeed 0.19
    MoE.router (E, C)        MoELayer.router.weight (TopKRouter)       MoE.deepspeed_moe.gate.wg
    experts[e].c_fc/c_proj   experts.local_experts[i].linear_fc1/fc2   .experts.deepspeed_experts[i]
                             (SequentialMLP; i = e - ep_rank * E/ep)   (deep copies of our module)
    route + top_k            topk_routing_with_score_function          top1gating / top2gating
    combine: sum w * out     the weight applied inside the expert,     _sparse_decode
                             after the activation (MLP per_token_scale)
    load_balancing_loss      switch_load_balancing_loss_func           l_aux, returned
    _AttachAuxLoss           MoEAuxLossAutoScaler (on the probs)       none: add coef * l_aux
    apply_ep's dispatchers   MoEAllGather/MoEAlltoAllTokenDispatcher   _AllToAll (capacity-padded)

The routing each computes, for a token's logits l over E experts, k chosen:
- ours, "softmax": w = the top-k entries of softmax(l), not renormalised (Switch).
- megatron: moe_router_pre_softmax=True is ours; its default (False) takes the top-k logits
  and a softmax over those k: w_i = p_i / sum of the chosen p (it refuses that at k = 1).
  The aux loss is ours at either setting (full softmax, every chosen slot counted).
- DeepSpeed: k = 1 is ours (gates * mask1). k = 2 renormalises, gates1 / (gates1 + gates2):
  megatron's default. Its top-2 l_aux is GShard's: f counts first choices only,
  E * sum_e f1_e P_e, f1_e = (tokens whose first choice is e) / N (`first_choice_aux`); at k = 1
  that is ours.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtl.megatron as dm
from dtl.deepspeed import import_deepspeed
from dtl.dist import run_device, timeout_s
from dtl.moe import LocalDispatcher, MoE, Routing, load_balancing_loss

# our expert's linears -> megatron's (an expert's parameter names otherwise agree)
MEGATRON_NAMES = {"c_fc": "linear_fc1", "c_proj": "linear_fc2"}
AuxFn = Callable[[Routing, int], torch.Tensor]


def megatron_name(ours: str) -> str:
    """'c_fc.weight' -> 'linear_fc1.weight'."""
    module, _, rest = ours.partition(".")
    return f"{MEGATRON_NAMES[module]}.{rest}"


def _shape(ours: MoE) -> tuple[int, int, bool]:
    """(C, expert hidden, bias) of our layer's experts."""
    fc = cast(nn.Linear, ours.experts["0"].get_submodule("c_fc"))
    return fc.in_features, fc.out_features, fc.bias is not None


def _mcore(module: str) -> Any:
    """megatron.core.<module>, imported when first needed (this module imports without it)."""
    return importlib.import_module(f"megatron.core.{module}")


# --- megatron-core ------------------------------------------------------------------------------


def init_expert_parallel(ep: int) -> None:
    """megatron's parallel_state with ep ranks per expert group (tp = pp = cp = 1, dp = the rest).
    Collective; undo with dtl.megatron.destroy_parallel_state()."""
    _mcore("parallel_state").initialize_model_parallel(
        expert_model_parallel_size=ep, order=dm.ORDER, distributed_timeout_minutes=timeout_s() / 60
    )


@contextlib.contextmanager
def moe_cpu_shim() -> Iterator[None]:
    """What megatron-core 0.16's MoE needs beyond dtl.megatron.cpu_shim, undone on exit: 1
    wherever Transformer Engine is absent, 2 and 3 when the run computes on the CPU.

    1. moe_utils names `te_general_gemm` only when Transformer Engine imports, but the router's
       RouterGatingLinearFunction reads it always: NameError without TE. None selects its torch.mm.
    2. The all-to-all dispatcher makes a class-wide side stream, `torch.cuda.Stream()` in its
       __init__ ("torch.cuda.Stream requires CUDA support"), and copies its split sizes to the
       host on it (`torch.cuda.current_stream()`, `torch.cuda.stream(...)`, an event). On a CPU
       the sizes are host tensors already: stand-in streams whose waits do nothing.
    3. That copy, `maybe_move_tensor_to_cpu(as_numpy=True)`, makes numpy arrays of CUDA tensors
       only; the CPU tensors it leaves are refused as split sizes by all_to_all_single
       ("TypeError: all_to_all_single(): incompatible function arguments", at ep > 1).
    """
    dm.check_shim_version()  # the patches were read in that version's source
    moe_utils = _mcore("transformer.moe.moe_utils")
    token_dispatcher = _mcore("transformer.moe.token_dispatcher")
    a2a = token_dispatcher.MoEAlltoAllTokenDispatcher
    main, side = _HostStream(), _HostStream()
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        moved = to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return moved.numpy() if as_numpy and torch.is_tensor(moved) else moved

    with contextlib.ExitStack() as patches:
        if not hasattr(moe_utils, "te_general_gemm"):
            patches.enter_context(
                mock.patch.object(moe_utils, "te_general_gemm", None, create=True)
            )
        if dm.run_on_cpu():
            patches.enter_context(mock.patch.object(a2a, "cuda_dtoh_stream", side))
            patches.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *_: main))
            patches.enter_context(
                mock.patch.object(torch.cuda, "stream", lambda _: contextlib.nullcontext())
            )
            patches.enter_context(
                mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", to_host_numpy)
            )
        yield


class _HostStream:
    """A CUDA stream and its event where every copy is already done."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


def megatron_config(
    ours: MoE, *, dispatcher: str = "allgather", pre_softmax: bool = True, **overrides: Any
) -> Any:  # a megatron TransformerConfig
    """The TransformerConfig whose MoELayer computes what `ours` computes (parallel_state first:
    its expert-parallel size is the config's)."""
    C, hidden, bias = _shape(ours)
    fields = dict(
        num_layers=1,  # the aux-loss tracker keeps one value per layer
        hidden_size=C,
        num_attention_heads=1,  # required, unused by an MoE layer
        ffn_hidden_size=hidden,
        num_moe_experts=ours.cfg.n_expert,
        moe_ffn_hidden_size=hidden,
        moe_router_topk=ours.cfg.top_k,
        # ours: softmax over all E, then the top k unrenormalised (megatron's default renormalises
        # over the k); "sigmoid": megatron renormalises the k sigmoid scores when k > 1
        moe_router_score_function=ours.cfg.router,
        moe_router_pre_softmax=pre_softmax,
        moe_router_dtype="fp32",  # ours routes in fp32 whatever the model's dtype
        moe_router_load_balancing_type="aux_loss",  # Switch's E * sum f P, ours
        moe_aux_loss_coeff=ours.cfg.aux_loss_coef,
        moe_expert_capacity_factor=None,  # dropless, as ours
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=_mcore("parallel_state").get_expert_model_parallel_world_size(),
        moe_grouped_gemm=False,  # SequentialMLP: TEGroupedMLP and GroupedMLP need TE / grouped_gemm
        # the experts' biases, and a router bias (zeroed). Biased experts run at ep > 1 only: at
        # ep 1 mlp.py's `output += output_bias * per_token_scale` raises "Output 0 of
        # _ReduceFromModelParallelRegion is a view and is being modified inplace"
        add_bias_linear=bias,
        activation_func=functools.partial(F.gelu, approximate="tanh"),  # our MLP's GELU(tanh)
        use_cpu_initialization=True,
        **dm.FUSIONS_OFF,
    )
    return _mcore("transformer").TransformerConfig(**{**fields, **overrides})


def megatron_moe(ours: MoE, **config: Any) -> Any:  # a megatron MoELayer
    """megatron-core's MoELayer holding `ours`'s router and this ep rank's experts.
    Needs parallel_state (`init_expert_parallel`) and, on a CPU, both shims."""
    cfg = megatron_config(ours, **config)
    specs = _mcore("models.gpt.moe_module_specs")  # use_te=False: the local (torch) layers
    spec = specs.get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)
    layer = _mcore("transformer.spec_utils").build_module(spec, config=cfg)
    layer.set_layer_number(1)  # its aux value is logged only for a numbered layer
    with torch.no_grad():
        layer.router.weight.copy_(ours.router.weight)
        if layer.router.bias is not None:
            layer.router.bias.zero_()  # ours has none
        for e, expert in megatron_experts(layer).items():
            for name, p in ours.experts[str(e)].named_parameters():
                expert.get_parameter(megatron_name(name)).copy_(p)
    return layer


def megatron_experts(layer: Any) -> dict[int, nn.Module]:
    """This rank's experts of a megatron MoELayer by global index."""
    return dict(zip(layer.local_expert_indices, layer.experts.local_experts, strict=True))


def megatron_forward(
    layer: Any, x: torch.Tensor, aux_loss_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, C) tokens -> (N, C) output, and the aux loss megatron logged (without its coefficient;
    None when it computed none: coefficient 0, eval mode or no grad). `aux_loss_scale` is our
    MoE.aux_loss_scale: megatron's MoEAuxLossAutoScaler.set_loss_scale, process-wide, set here
    for this backward."""
    moe_utils = _mcore("transformer.moe.moe_utils")
    scale = torch.tensor(aux_loss_scale, device=run_device())
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(scale)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.pop("load_balancing_loss", None)  # its values accumulate over forwards
    y, bias = layer(x.view(x.size(0), 1, x.size(1)))  # megatron's [s, b, h]
    assert bias is None  # an MoELayer adds its experts' biases itself
    logged = tracker.get("load_balancing_loss")
    return y.view_as(x), None if logged is None else logged["values"][0].clone()


# --- DeepSpeed ----------------------------------------------------------------------------------


def deepspeed_moe(ours: MoE, ep_size: int = 1) -> Any:  # a deepspeed.moe.layer.MoE
    """DeepSpeed's MoE layer holding `ours`'s router and this ep rank's experts: dropless, no
    random token selection, no sampled second expert. Needs deepspeed.comm initialised."""
    import_deepspeed(run_device().type)
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    C, _, _ = _shape(ours)
    layer = DeepSpeedMoE(
        C,
        expert=ours.experts["0"],  # deep-copied E/ep times, then loaded below
        num_experts=ours.cfg.n_expert,
        ep_size=ep_size,
        k=ours.cfg.top_k,  # 1 or 2 (k > 2 is its topkgating: renormalised as well)
        drop_tokens=False,  # capacity = the most rows any expert gets, max over the ep group
        min_capacity=0,  # top1gating asserts N >= min_capacity
        use_rts=False,  # random token selection only chooses which tokens a full expert drops
        top2_2nd_expert_sampling=False,  # else Gumbel noise picks the second expert
        noisy_gate_policy=None,
    )
    layer.set_deepspeed_parallelism()  # its expert / expert-data groups ("ep_size_<n>")
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for e, expert in deepspeed_experts(layer).items():
            expert.load_state_dict(ours.experts[str(e)].state_dict())
    return layer


def deepspeed_experts(layer: Any) -> dict[int, nn.Module]:
    """This rank's experts of a DeepSpeed MoE by global index: rank r of the ep group holds
    r*E/ep .. (r+1)*E/ep - 1 (its all-to-all sends expert block r to rank r)."""
    moe = layer.deepspeed_moe
    local = moe.experts.deepspeed_experts
    first = dist.get_rank(moe.ep_group) * len(local)
    return {first + i: expert for i, expert in enumerate(local)}


# --- our layer with the libraries' other choices ------------------------------------------------


def renormalised(routing: Routing) -> Routing:
    """The top-k weights divided by their sum: megatron's default routing, DeepSpeed's top-2."""
    w = routing.weights
    return Routing(routing.experts, w / w.sum(dim=-1, keepdim=True), routing.scores)


def first_choice_aux(routing: Routing, n_expert: int) -> torch.Tensor:
    """GShard's aux loss, DeepSpeed's top-2 l_aux: Switch's form with f over first choices."""
    first = Routing(routing.experts[:, :1], routing.weights[:, :1], routing.scores)
    return load_balancing_loss(first, n_expert)


def reference_forward(
    ours: MoE, x: torch.Tensor, *, renormalise: bool = False, aux: AuxFn = load_balancing_loss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our layer's steps (MoE.forward) with the top-k weights optionally renormalised and another
    aux loss; the aux is returned, not attached: add coef * aux to the loss."""
    tokens = x.reshape(-1, x.size(-1))
    routing = ours.route(tokens)
    if renormalise:
        routing = renormalised(routing)
    y = LocalDispatcher()(tokens, routing, ours.experts, ours.cfg.n_expert)
    return y.view_as(x), aux(routing, ours.cfg.n_expert)
