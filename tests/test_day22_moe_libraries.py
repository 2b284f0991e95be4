"""Day 22: megatron-core's MoELayer and DeepSpeed's MoE against ours (dtl/moe.py), on the same
weights and tokens (day22_megatron/moe_libraries.py).

Two gloo ranks, one spawn for the file (`results`). The layer: C = 16, E = 4 experts of hidden
32, softmax router, aux coefficient 0.1 (large enough that its gradient shows in the router's),
12 tokens per rank. Per case: the output, the input gradient, the router gradient (the aux
loss's included: megatron attaches it as ours does, DeepSpeed's l_aux is added to the loss),
each expert's gradients (at ep 2 against ours summed over the ep group: the expert's owner ran
both ranks' rows), the aux value. fp32, rtol 1e-5, atol 1e-6: the same sums in another order,
measured <= 7.2e-7; the planted differences are >= 2e-4.

- megatron-core 0.16.1 (moe_router_pre_softmax=True, SequentialMLP experts without biases):
  ours at k = 1 and 2, ep 1 and 2, with the all-gather and the all-to-all dispatcher; biased
  experts at ep 2; our aux_loss_scale as its MoEAuxLossAutoScaler scale. Its default routing
  (pre_softmax=False) is ours with the top-k weights renormalised. Its sigmoid router is ours at
  k = 1 (the score as it is) and k = 2 (renormalised).
- DeepSpeed 0.19 (experts with biases: they are deep copies of our module), ep 1 and 2: k = 1
  is ours; k = 2 is ours renormalised (megatron's default), with GShard's aux (first choices).
Planted, each failing the same comparison: megatron's default routing taken for ours, megatron
without its aux loss (the output matches, the gradients through the router do not), DeepSpeed's
top-2 taken for ours.

On a CPU megatron's MoE ran with three patches besides dtl.megatron.cpu_shim (moe_cpu_shim):
without Transformer Engine its router raises "NameError: name 'te_general_gemm' is not defined";
the all-to-all dispatcher's __init__ raises "RuntimeError: torch.cuda.Stream requires CUDA
support", and at ep 2 all_to_all_single refuses its split sizes, CPU tensors where a GPU run
has numpy arrays ("TypeError: all_to_all_single(): incompatible function arguments").
"""

import pytest
import torch
import torch.distributed as dist

import dtl.megatron as dm
from day22_megatron.moe_libraries import (
    deepspeed_experts,
    deepspeed_moe,
    first_choice_aux,
    init_expert_parallel,
    megatron_experts,
    megatron_forward,
    megatron_moe,
    megatron_name,
    moe_cpu_shim,
    reference_forward,
)
from dtl import dist as dtl_dist
from dtl import extras
from dtl.model import MLP, preset
from dtl.moe import MoE, MoEConfig, load_balancing_loss
from dtl.testing import needs_extras, run_distributed

C, HIDDEN, E, N, COEF = 16, 32, 4, 12, 0.1
RTOL, ATOL = 1e-5, 1e-6
MEGATRON_CASES = [(ep, d, k) for ep in (1, 2) for d in ("allgather", "alltoall") for k in (1, 2)]
DEEPSPEED_CASES = [(ep, k) for ep in (1, 2) for k in (1, 2)]


def _ours(k: int, router: str = "softmax", bias: bool = False) -> MoE:
    cfg = preset("tiny", n_embd=C, n_head=1, bias=bias, dropout=0.0)
    moe = MoEConfig(n_expert=E, top_k=k, router=router, aux_loss_coef=COEF, expert_hidden=HIDDEN)
    torch.manual_seed(0)  # the same weights on every rank
    return MoE(C, moe, lambda: MLP(cfg, HIDDEN))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and the output gradient it backpropagates."""
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    return torch.randn(N, C, generator=gen), torch.randn(N, C, generator=gen)


def _ours_run(ours: MoE, group, renormalise: bool = False, aux=load_balancing_loss) -> dict:
    """Our layer (MoE.forward itself unless the routing or the aux is another) on this rank's
    tokens; expert gradients summed over `group`, the ranks whose rows an expert's owner runs."""
    x, g = _tokens()
    x.requires_grad_()
    if renormalise or aux is not load_balancing_loss:
        y, aux_value = reference_forward(ours, x, renormalise=renormalise, aux=aux)
        ((y * g).sum() + COEF * aux_value).backward()
    else:
        y = ours(x)
        (y * g).sum().backward()
        aux_value = ours.last_aux_loss
    out = {"output": y.detach(), "input": x.grad, "router": ours.router.weight.grad}
    out["aux"] = aux_value.detach()
    for e, expert in ours.experts.items():
        for name, p in expert.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            out[f"expert {e} {name}"] = grad
    return out


def _differences(theirs: dict, ours: dict) -> dict:
    """Max |difference| per quantity, and whether it is within rtol/atol."""
    return {
        key: ((t - ours[key]).abs().max().item(), torch.allclose(t, ours[key], RTOL, ATOL))
        for key, t in theirs.items()
    }


def _megatron_case(
    k: int,
    dispatcher: str = "allgather",
    router: str = "softmax",
    renormalise: bool | None = None,
    aux_scale: float = 1.0,
    bias: bool = False,
    **config,
) -> dict:
    """megatron's layer built from ours (`config`: megatron_config's overrides) against ours,
    renormalised where megatron's default routing is asked for unless `renormalise` says."""
    from megatron.core import parallel_state

    ours = _ours(k, router, bias)
    ours.aux_loss_scale = aux_scale  # megatron's MoEAuxLossAutoScaler.set_loss_scale
    layer = megatron_moe(ours, dispatcher=dispatcher, **config)
    x, g = _tokens()
    x.requires_grad_()
    y, aux = megatron_forward(layer, x, aux_loss_scale=aux_scale)
    (y * g).sum().backward()
    theirs = {"output": y.detach(), "input": x.grad, "router": layer.router.weight.grad}
    if aux is not None:
        theirs["aux"] = aux
    for e, expert in megatron_experts(layer).items():
        for name, _ in ours.experts[str(e)].named_parameters():
            theirs[f"expert {e} {name}"] = expert.get_parameter(megatron_name(name)).grad
    if renormalise is None:
        renormalise = not config.get("pre_softmax", True)
    group = parallel_state.get_expert_model_parallel_group()
    return _differences(theirs, _ours_run(ours, group, renormalise=renormalise))


def _megatron_checks() -> dict:
    from megatron.core import tensor_parallel

    out = {}
    for ep in (1, 2):
        init_expert_parallel(ep)
        try:
            with dm.cpu_shim(), moe_cpu_shim():
                tensor_parallel.model_parallel_cuda_manual_seed(0)
                for _, dispatcher, k in (c for c in MEGATRON_CASES if c[0] == ep):
                    out[ep, dispatcher, k] = _megatron_case(k, dispatcher)
                if ep == 2:  # biased experts raise in megatron at ep 1 (megatron_config)
                    out["biases"] = _megatron_case(2, bias=True)
                if ep == 1:
                    out["aux scale 1/2"] = _megatron_case(2, aux_scale=0.5)
                    out["default is renormalised"] = _megatron_case(2, pre_softmax=False)
                    for k in (1, 2):
                        out["sigmoid", k] = _megatron_case(k, router="sigmoid")
                    # planted: its default routing taken for ours; its aux loss switched off
                    out["planted: default"] = _megatron_case(
                        2, pre_softmax=False, renormalise=False
                    )
                    out["planted: no aux"] = _megatron_case(2, moe_aux_loss_coeff=0.0)
        finally:
            dm.destroy_parallel_state()
    return out


def _deepspeed_case(k: int, ep: int, plant: bool = False) -> dict:
    """DeepSpeed's layer built from ours against ours (with biases: its experts are our module),
    renormalised with GShard's aux at k = 2 unless `plant`."""
    from deepspeed.utils import groups

    ours = _ours(k, bias=True)
    layer = deepspeed_moe(ours, ep)
    x, g = _tokens()
    x.requires_grad_()
    y, l_aux, counts = layer(x)
    ((y * g).sum() + COEF * l_aux).backward()
    theirs = {"output": y.detach(), "input": x.grad, "aux": l_aux.detach()}
    theirs["router"] = layer.deepspeed_moe.gate.wg.weight.grad
    for e, expert in deepspeed_experts(layer).items():
        for name, p in expert.named_parameters():
            theirs[f"expert {e} {name}"] = p.grad
    group = groups._get_expert_parallel_group(f"ep_size_{ep}")
    top2 = k == 2 and not plant  # DeepSpeed's top-2: renormalised, GShard's aux
    aux = first_choice_aux if top2 else load_balancing_loss
    out = _differences(theirs, _ours_run(ours, group, renormalise=top2, aux=aux))
    with torch.no_grad():
        ours(x)
    out["rows per expert"] = (0.0, torch.equal(counts, ours.last_tokens_per_expert))
    return out


def _deepspeed_checks() -> dict:
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend="gloo")  # adopts the process group already up
    out = {("deepspeed",) + case: _deepspeed_case(case[1], case[0]) for case in DEEPSPEED_CASES}
    out["planted: deepspeed top-2 vs ours"] = _deepspeed_case(2, 1, plant=True)
    return out


def _checks(libraries: list[str]) -> dict:
    dtl_dist.init()
    out = {}
    if "megatron" in libraries:
        out.update(_megatron_checks())
    if "deepspeed" in libraries:
        out.update(_deepspeed_checks())
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    installed = [e for e in ("megatron", "deepspeed") if not extras.missing([e])]
    return run_distributed(_checks, installed, world_size=2)


def _assert_equal(results: list[dict], case) -> None:
    for rank, got in enumerate(results):
        bad = {key: diff for key, (diff, ok) in got[case].items() if not ok}
        assert not bad, f"rank {rank} {case}: {bad}"


@needs_extras("megatron")
@pytest.mark.parametrize("case", MEGATRON_CASES, ids=lambda c: f"ep{c[0]}-{c[1]}-k{c[2]}")
def test_megatron_moe_layer_is_ours(results, case):
    _assert_equal(results, case)


@needs_extras("megatron")
def test_megatron_aux_loss_scale_and_expert_biases_are_ours(results):
    _assert_equal(results, "aux scale 1/2")
    _assert_equal(results, "biases")


@needs_extras("megatron")
def test_megatron_default_routing_is_ours_renormalised(results):
    _assert_equal(results, "default is renormalised")


@needs_extras("megatron")
def test_megatron_sigmoid_router_is_ours(results):
    # k = 2: the two scores renormalised; k = 1: the one sigmoid score kept as it is (divided
    # by itself it would always be 1, and the router would learn from the aux loss alone)
    _assert_equal(results, ("sigmoid", 2))
    _assert_equal(results, ("sigmoid", 1))


@needs_extras("megatron")
def test_megatron_planted_differences_fail(results):
    for got in results:
        assert not got["planted: default"]["output"][1]  # its default routing taken for ours
        no_aux = got["planted: no aux"]  # its aux loss off: the same output, not the same
        assert no_aux["output"][1] and not no_aux["router"][1]  # gradient through the router
        assert "aux" not in no_aux  # none logged


@needs_extras("deepspeed")
@pytest.mark.parametrize("case", DEEPSPEED_CASES, ids=lambda c: f"ep{c[0]}-k{c[1]}")
def test_deepspeed_moe_is_ours(results, case):
    _assert_equal(results, ("deepspeed",) + case)


@needs_extras("deepspeed")
def test_deepspeed_planted_difference_fails(results):
    for got in results:
        top2 = got["planted: deepspeed top-2 vs ours"]  # not renormalised, Switch's aux
        assert not top2["output"][1] and not top2["aux"][1]
