"""Day 28: DeepSpeed's ZeRO engine as a strategy, stage 2 (day 18) and stage 3 (day 23).

    zero2   gradients and Adam's state sharded, parameters whole on every rank
    zero3   parameters sharded too, each gathered whole while a step runs

The engine is built from a ds_config made of the recipe (AdamW, clipping, bf16) and checked by
the kit (dtl.deepspeed.check_sections) before any collective; its state is read back from the
engine's own partitions. Checkpoints: DeepSpeed's save_checkpoint / load_checkpoint.

DeepSpeed is an optional extra (`extras = ("deepspeed",)`): this module imports without it, and
imports it only when a strategy is built, through dtl.deepspeed.import_deepspeed, which sets
DeepSpeed's accelerator to the run's device first (it is chosen at DeepSpeed's first import).
"""

from __future__ import annotations

import torch.distributed as dist

from day18_zero import formulas
from day18_zero.ds_engine import ds_state_bytes
from day23_zero3_offload.measure import locations
from day28_gpt125m.strategy import Setup, Strategy, register
from dtl import profile as dtl_profile
from dtl.deepspeed import apply_precision, check_sections, import_deepspeed
from dtl.model import GPT, loss_fn, num_params
from dtl.optim import optimizer_groups, set_lr
from dtl.precision import ANY_DEVICE, PRECISIONS, declare
from dtl.state import KINDS as STATE_KINDS
from dtl.state import StateBytes

# DeepSpeed's bf16 section, anywhere (its fp16 section and loss scaler are not wired here)
ZERO_SECTIONS = declare(
    "day 28's DeepSpeed ZeRO-2 and ZeRO-3",
    {"fp32": ANY_DEVICE, "bf16": ANY_DEVICE},
    why="fp16 and its loss scaler are not wired here; DeepSpeed has no float8 matmuls",
)


class DeepSpeedZero(Strategy):
    """DeepSpeed's engine at ZeRO stage `stage`, on a ds_config built from the recipe and checked
    by the kit (dtl.deepspeed.check_sections) before any collective."""

    stage = 0
    extras = ("deepspeed",)
    support = ZERO_SECTIONS
    suggested_when_short = True
    no_recompute = "--recompute is not wired for DeepSpeed here (untested); use ddp, fsdp2, tp_pp"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, ep=1, replicas=1, precision="fp32"):
        # day 18's table: DeepSpeed keeps an fp32 master beside fp32 parameters too
        held = PRECISIONS[precision].with_fp32_master()
        psi = num_params(m)
        resident = formulas.model_state_bytes(psi, world, cls.stage, held).total
        return resident, cls.gathered(psi, precision)

    @classmethod
    def gathered(cls, psi: int, precision: str) -> float:
        return 0.0  # stages 1 and 2 keep every parameter whole: nothing more to gather

    def zero_section(self) -> dict:
        return {"stage": self.stage}

    def __init__(self, s: Setup):
        r = self.r = s.recipe
        gpt = GPT(s.cfg, seed=s.seed)  # DeepSpeed moves it to the accelerator's device
        # the deepspeed module, imported here (an optional extra) with its accelerator = the
        # run's device; kept for full_parameters' GatheredParameters
        self.deepspeed = import_deepspeed(s.device.type)
        adamw = r.optim.deepspeed_params()
        ds = {
            "train_micro_batch_size_per_gpu": s.micro_batch,
            "gradient_accumulation_steps": s.accum,
            "optimizer": {"type": "AdamW", "params": adamw},
            "gradient_clipping": r.clip,
            "zero_optimization": self.zero_section(),
            "steps_per_print": 10**9,
        }
        apply_precision(ds, r.precision, s.device.type)  # DeepSpeed's section for the row
        check_sections(ds)  # the kit's checks, as every ds_config of the course
        self.engine, *_ = self.deepspeed.initialize(
            model=gpt,
            model_parameters=optimizer_groups(gpt, r.weight_decay),
            config=ds,
            dist_init_required=False,
        )

    def step(self, micro_batches, lr):
        set_lr(self.engine.optimizer, lr)
        total, last = 0.0, len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            with dtl_profile.range(dtl_profile.FORWARD):
                loss = loss_fn(self.engine(x), y)
            with dtl_profile.range(dtl_profile.BACKWARD):
                self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            if i == last and self.measure_state:  # before the update: grads and state both live
                self.last_state = self.state_bytes()
            with dtl_profile.range(dtl_profile.OPTIMIZER):
                self.engine.step()  # a no-op until the accumulation boundary
            total += loss.item()
        return total / len(micro_batches), float(self.engine.get_global_grad_norm())

    def state_bytes(self) -> StateBytes:
        return ds_state_bytes(self.engine, self.stage)  # read from the engine's partitions

    def save(self, folder, step):
        self.engine.save_checkpoint(folder, tag=f"step_{step}", client_state={"step": step})

    def load(self, folder):
        _, client = self.engine.load_checkpoint(folder)  # the tag in `latest`
        return client["step"]

    def full_parameters(self):
        params = list(self.engine.module.named_parameters())
        gathered = self.deepspeed.zero.GatheredParameters(
            [p for _, p in params], enabled=self.stage == 3
        )
        with gathered:
            return {n: p.detach().float().cpu().clone() for n, p in params}


@register
class ZeRO2(DeepSpeedZero):
    name = "zero2"
    stage = 2


@register
class ZeRO3(DeepSpeedZero):
    name = "zero3"
    stage = 3

    @classmethod
    def gathered(cls, psi, precision):
        # every parameter, full, while a step runs (day 23)
        return PRECISIONS[precision].param * psi

    def zero_section(self) -> dict:
        return {"stage": 3, "stage3_param_persistence_threshold": 0}

    def state_bytes(self) -> StateBytes:
        where = locations(self.engine, dist.get_rank())  # by location: device, CPU, NVMe
        return StateBytes(*(sum(where[loc][k] for loc in where) for k in STATE_KINDS))
