"""DeepSpeed works here, as the later days use it: ZeRO-1/2/3 and CPU offload on gloo ranks equal
one process running torch's Adam on the global batch, with the ops `make install` pre-built.

Not day 18's lesson (that builds ZeRO by hand); the proof that CI runs DeepSpeed for real. Model:
`tiny-nobias`, whose every parameter gets a real gradient, so Adam's per-parameter normalisation
cannot blow rounding noise up into lr-sized steps (dtl.model's docstring).
"""

import os

import numpy as np
import torch
import torch.distributed as dist

from dtl.data import get_batch
from dtl.model import GPT, loss_fn, preset
from dtl.reference import flat_params, reference_train
from dtl.testing import needs_extras, run_distributed

pytestmark = needs_extras("deepspeed")
try:
    import deepspeed
except ImportError:
    deepspeed = None  # every test is skipped by the mark above (failed under make test)

CFG = preset("tiny-nobias")
B, T, STEPS, LR, EPS = 2, 16, 3, 1e-2, 1e-6
# fp32 Adam after 3 steps. The two sides sum gradients in different orders, so a gradient differs
# by delta ~ 2e-9 (measured). Adam's step lr * g / (|g| + eps) is most sensitive to that where
# |g| ~ eps: by lr * delta / (4 eps) = 1e-2 * 2e-9 / 4e-6 = 5e-6 with eps = 1e-6 (measured max
# 6e-6; with torch's default eps = 1e-8 it would be 100x more). atol 2e-5 holds that and still
# fails DeepSpeed's default gradient clipping (the control below: 12% shorter steps).
TOL = dict(rtol=1e-5, atol=2e-5)
MODES = {  # name -> zero_optimization section
    "zero1 clipped (control)": {"stage": 1},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2+cpu-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, CFG.vocab_size, 10_000).astype(np.uint16)


def _ds_config(zero: dict, world: int, clip: bool = False) -> dict:
    config = {
        "train_batch_size": B * world,
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise: here the norm
        # is ~1.1 at init, so its steps would be 12% shorter than torch's (measured)
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if clip:  # DeepSpeed's own default: clip the global norm to 1.0
        del config["gradient_clipping"]
    return config


def _deepspeed_runs():
    rank, world = dist.get_rank(), dist.get_world_size()
    data, out = _tokens(), {}
    for name, zero in MODES.items():
        engine, *_ = deepspeed.initialize(
            model=GPT(CFG, seed=0),
            config=_ds_config(zero, world, clip="control" in name),
            dist_init_required=False,
        )
        losses = []
        for step in range(STEPS):
            x, y = get_batch(data, T, B, seed=0, step=step, dp_rank=rank, dp_size=world)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if zero["stage"] == 3:  # parameters are sharded: gather them to compare
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                params = flat_params(engine.module).clone()
        else:
            params = flat_params(engine.module).clone()
        out[name] = (losses, params, type(engine.basic_optimizer).__name__)
    return out


def _reference(world: int):
    model = GPT(CFG, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    data = _tokens()
    losses = reference_train(
        model, lambda s: get_batch(data, T, B * world, seed=0, step=s), opt, STEPS
    )
    return losses, flat_params(model)


def test_zero_stages_and_cpu_offload_equal_one_process_adam_with_prebuilt_ops():
    ext = os.environ["TORCH_EXTENSIONS_DIR"]
    per_rank = run_distributed(_deepspeed_runs, world_size=2, timeout_s=240)
    ref_losses, ref_params = _reference(world=2)
    control = per_rank[0]["zero1 clipped (control)"][1]
    assert (control - ref_params).abs().max() > 10 * TOL["atol"], "the tolerance cannot fail"
    for name in [m for m in MODES if "control" not in m]:
        losses, params, _ = per_rank[0][name]
        # rank 0's loss is its half of the batch: compare the mean of both ranks' losses
        mean = [(a + b) / 2 for a, b in zip(losses, per_rank[1][name][0])]
        torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), **TOL)
        torch.testing.assert_close(params, ref_params, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(params, per_rank[1][name][1]), f"{name}: ranks differ"
    assert ref_params.sub(flat_params(GPT(CFG, seed=0))).abs().max() > 1e-3  # Adam moved them
    optimizers = {name: per_rank[0][name][2] for name in MODES}
    assert optimizers["zero2+cpu-offload"] == "DeepSpeedCPUAdam", optimizers  # the C++ op ran
    assert optimizers["zero2"] == "FusedAdam", optimizers
    for op in ("deepspeed_shm_comm", "cpu_adam", "fused_adam"):
        assert os.path.isdir(os.path.join(ext, op)), f"{op} was not pre-built in {ext}"
