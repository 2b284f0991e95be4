"""Day 28: one interface over every strategy of the course, so one loop trains them all.

    s = build("fsdp2", cfg, recipe, grid, device)       # any name in REGISTRY
    loss, norm = s.step(micro_batches, lr)              # one optimizer step (accumulation inside)
    full = s.full_parameters()                          # the dense model's tensors (collective)
    s.close()

    strategy  built from                  the DP sync                 the optimizer
    ddp       torch DDP (day 17)           all-reduce in buckets       AdamW, full state per rank
    fsdp2     torch fully_shard (day 18)   reduce-scatter / all-gather AdamW on each rank's shard
    zero2     DeepSpeed ZeRO-2 (day 18)    reduce-scatter / all-gather DeepSpeed's AdamW on shards
    zero3     DeepSpeed ZeRO-3 (day 23)    reduce-scatter / all-gather DeepSpeed's AdamW on shards
    tp_pp     our stack (day 22): apply_tp -> apply_pp, DP by average_gradients; torch AdamW
    megatron  megatron-core (day 22): GPTModel, its schedule, DDP, DistributedOptimizer

Each strategy is a class in REGISTRY that says what it supports (model parallelism, --precision,
--compile, checkpoints) and predicts its own per-rank model state (fit.py asks it): adding one is
a class here with @register, and the config, the fit check and the tests take it from there.

Checkpoints: DDP, FSDP2, our TP + PP and TP + SP through day 24's Checkpointer (DCP: sharded,
atomic, reshardable; every TP shard a DTensor, day24_checkpoint/sharded.py, loads at another tp,
pp or dp), DeepSpeed's ZeRO through its save_checkpoint; megatron-core's dist_checkpointing is
not wired here (train.py refuses --resume).

Every strategy takes the same recipe (AdamW betas 0.9/0.95, decay on matrices only, global-norm
clipping, the learning rate of this step) and the same global batch, so every one must train like
the one-process GPT: tests/test_day28_gpt125m.py checks that, strategy by strategy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from day28_gpt125m.recipe import Recipe, autocast, make_adamw
from day28_gpt125m.strategy import REGISTRY, Strategy, register
from dtl import profile as dtl_profile
from dtl.exercise_seam import exercise
from dtl.grid import ParallelGrid
from dtl.model import GPT, GPTConfig, loss_fn, num_params
from dtl.optim import optimizer_groups, set_lr
from dtl.precision import PRECISIONS
from dtl.state import KINDS as STATE_KINDS
from dtl.state import StateBytes, live_state_bytes


class TorchData(Strategy):
    """DDP or FSDP2 on the whole GPT: torch's own data parallelism."""

    precisions = ("fp32", "bf16")  # bf16: autocast (fp16 would need a GradScaler: not wired)
    compile = True

    def __init__(self, cfg: GPTConfig, r: Recipe, grid: ParallelGrid, device, *, seed: int,
                 recompute: str, **_):  # fmt: skip
        self.r, self.device = r, device
        gpt = GPT(cfg, seed=seed).to(device)
        gpt.set_recompute(recompute)  # before DDP or fully_shard wrap the blocks
        if self.name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.gpt = gpt
            self.model = DDP(gpt, device_ids=[device.index] if device.type == "cuda" else None)
            self.sync_off = self.model.no_sync  # no all-reduce until the last micro-batch
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            # the run's device type, said: FSDP2's default mesh is torch's accelerator (CUDA on
            # any GPU machine), which under gloo would shard onto cuda:0 beside CPU batches
            mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
            for block in gpt.blocks.values():  # bottom-up: each block its own all-gather unit
                fully_shard(block, mesh=mesh)
            self.model = self.gpt = fully_shard(gpt, mesh=mesh)
            self.sync_off = self._fsdp_no_sync
        self.optimizer = make_adamw(self.gpt, r)

    @contextlib.contextmanager
    def _fsdp_no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @exercise("day28.strategy_step")
    def step(self, micro_batches, lr):
        # k micro-batches: loss_fn(self.model(x), y) / k each, under autocast(self.r, self.device);
        # gradients sync only in the last one (the others inside self.sync_off(): DDP decides in
        # forward). Then the global norm clipped at self.r.clip, the lr, the update -> total, norm
        # exercise day28.strategy_step: begin
        total, k = 0.0, len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            with self.sync_off() if i < k - 1 else contextlib.nullcontext():
                with dtl_profile.range(dtl_profile.FORWARD), autocast(self.r, self.device):
                    loss = loss_fn(self.model(x), y) / k
                with dtl_profile.range(dtl_profile.BACKWARD):
                    loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), self.r.clip or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of the global norm
            norm = norm.full_tensor()
        set_lr(self.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.optimizer.step()
        # exercise day28.strategy_step: end
        if self.measure_state:
            # an FSDP2 parameter counts its local shard only: what is in this rank's memory;
            # AdamW's 4-byte step counters are no per-parameter state (the formula's 16 Ψ)
            self.last_state = live_state_bytes(
                self.gpt.parameters(), self.optimizer, counters=False
            )
        self.optimizer.zero_grad(set_to_none=True)
        return total, float(norm)

    def _app(self, step: int = 0):
        from day24_checkpoint.ckpt import AppState, Progress

        return AppState(self.model, self.optimizer, progress=Progress(step=step))

    def save(self, folder, step):
        # day 24: DCP, every rank writing its shards, an atomic commit, `latest`
        from day24_checkpoint.ckpt import Checkpointer

        Checkpointer(folder, keep=2).save(self._app(step), step)

    def load(self, folder):
        from day24_checkpoint.ckpt import Checkpointer

        return Checkpointer(folder, keep=2).load(self._app())

    def full_parameters(self):
        out = {}
        for name, p in self.gpt.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards: gathered
            out[name] = t.detach().float().cpu().clone()
        return out


@register
class DDP(TorchData):
    name = "ddp"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, precision="fp32"):
        return 16 * num_params(m), 0.0  # 4 param + 4 grad + 8 Adam, on every rank (day 18)


@register
class FSDP2(TorchData):
    name = "fsdp2"
    suggested_when_short = True

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, precision="fp32"):
        from day19_tp.formulas import block_params

        return 16 * num_params(m) / world, 4 * block_params(m, 1)  # + the largest block, full


class DeepSpeedZero(Strategy):
    """DeepSpeed's engine at ZeRO stage `stage`, on a ds_config built from the recipe and checked
    by the kit (dtl.deepspeed.check_sections) before any collective."""

    stage = 0
    extras = ("deepspeed",)
    precisions = ("fp32", "bf16")  # DeepSpeed's bf16 section (fp16's loss scaler: not wired)
    suggested_when_short = True
    no_recompute = "--recompute is not wired for DeepSpeed here (untested); use ddp, fsdp2, tp_pp"

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, precision="fp32"):
        # day 18's table: DeepSpeed keeps an fp32 master beside fp32 parameters too
        from day18_zero import formulas

        held = PRECISIONS[precision].with_fp32_master()
        psi = num_params(m)
        resident = formulas.model_state_bytes(psi, world, cls.stage, held).total
        return resident, cls.gathered(psi, precision)

    @classmethod
    def gathered(cls, psi: int, precision: str) -> float:
        return 0.0  # stages 1 and 2 keep every parameter whole: nothing more to gather

    def zero_section(self) -> dict:
        return {"stage": self.stage}

    def __init__(self, cfg: GPTConfig, r: Recipe, grid: ParallelGrid, device, *,
                 micro_batch: int, accum: int, seed: int, **_):  # fmt: skip
        from dtl.deepspeed import check_sections, import_deepspeed

        gpt = GPT(cfg, seed=seed)  # DeepSpeed moves it to the accelerator's device
        deepspeed = import_deepspeed(device.type)  # its accelerator = the run's device
        self.r = r
        adamw = r.optim.deepspeed_params()
        ds = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accum,
            "optimizer": {"type": "AdamW", "params": adamw},
            "gradient_clipping": r.clip,
            "bf16": {"enabled": r.precision == "bf16"},
            "zero_optimization": self.zero_section(),
            "steps_per_print": 10**9,
        }  # fmt: skip
        check_sections(ds)  # the kit's checks, as every ds_config of the course
        self.engine, *_ = deepspeed.initialize(
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
        from day18_zero.ds_engine import ds_state_bytes  # read from the engine's partitions

        return ds_state_bytes(self.engine, self.stage)

    def save(self, folder, step):
        self.engine.save_checkpoint(folder, tag=f"step_{step}", client_state={"step": step})

    def load(self, folder):
        _, client = self.engine.load_checkpoint(folder)  # the tag in `latest`
        return client["step"]

    def full_parameters(self):
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=self.stage == 3):
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
        from day23_zero3_offload.measure import locations  # by location: device, CPU, NVMe

        where = locations(self.engine, dist.get_rank())
        return StateBytes(*(sum(where[loc][k] for loc in where) for k in STATE_KINDS))


def _stage_state(m: GPTConfig, world: int, tp: int, pp: int, pp_rank: int, distopt: bool) -> float:
    """Day 22's formulas.state_bytes of pipeline stage `pp_rank` (the TP shard of its layers,
    the embedding on the first stage, the head on the last)."""
    from day22_megatron import formulas
    from day22_megatron.layouts import Layout

    lay = Layout(tp=tp, pp=pp, dp=world // (tp * pp))
    return sum(formulas.state_bytes(m, lay, pp_rank, distopt).values())


def _fullest_stage(m: GPTConfig, world: int, tp: int, pp: int, distopt: bool) -> float:
    """The stage that holds the most: what every rank must have room for."""
    return max(_stage_state(m, world, tp, pp, r, distopt) for r in range(pp))


class Pipelined(Strategy):
    """TP x PP x DP: each stage's state by day 22's formulas (the first stage holds the
    embedding, the last the head); `distributed_optimizer`: Adam's m and v sharded over dp."""

    model_parallel = True
    distributed_optimizer = False

    @classmethod
    def predicted_state(cls, m, *, world, tp=1, pp=1, precision="fp32"):
        return _fullest_stage(m, world, tp, pp, distopt=cls.distributed_optimizer), 0.0

    @classmethod
    def predicted_rank_state(cls, m, *, world, tp=1, pp=1, pp_rank=0, precision="fp32"):
        return _stage_state(m, world, tp, pp, pp_rank, distopt=cls.distributed_optimizer)


@register
class OurTPPP(Pipelined):
    """Day 22's stack: TP over grid.tp_group, the pipeline over grid.pp_group, DP beside."""

    name = "tp_pp"

    def __init__(self, cfg: GPTConfig, r: Recipe, grid: ParallelGrid, device, *,
                 micro_batch: int, accum: int, seq_len: int, seed: int, recompute: str,
                 **_):  # fmt: skip
        from day22_megatron import stack

        self.stack_mod, self.r = stack, r
        self.stack = stack.build_stack(
            cfg, grid, micro_batch_size=micro_batch, microbatches=accum, seq_len=seq_len,
            seed=seed, optim=r.optim, device=device, sp=self.sequence_parallel,
            recompute=recompute,
        )  # fmt: skip

    def step(self, micro_batches, lr):
        s = self.stack_mod
        loss = s.forward_backward(self.stack, micro_batches)
        s.sync_gradients(self.stack)
        norm = s.clip_gradients(self.stack, self.r.clip or None)
        set_lr(self.stack.optimizer, lr)
        with dtl_profile.range(dtl_profile.OPTIMIZER):
            self.stack.optimizer.step()
        if self.measure_state:
            self.last_state = self.stack_mod.stack_state_bytes(self.stack)
        self.stack.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def _app(self, step: int = 0):
        from day24_checkpoint.ckpt import Progress
        from day24_checkpoint.sharded import StackState

        return StackState(self.stack, Progress(step=step))

    def save(self, folder, step):
        # day 24: DCP, every TP shard a DTensor, the stages' keys merged, an atomic commit:
        # it loads at another tp, pp or dp (day24_checkpoint/sharded.py)
        from day24_checkpoint.ckpt import Checkpointer

        Checkpointer(folder, keep=2).save(self._app(step), step)

    def load(self, folder):
        from day24_checkpoint.ckpt import Checkpointer

        return Checkpointer(folder, keep=2).load(self._app())

    def full_parameters(self):
        return _untied(self.stack_mod.full_state(self.stack), self.stack.gpt.cfg)


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
class Megatron(Pipelined):
    """megatron-core itself (day 22's mcore library), the recipe's lr set per step."""

    name = "megatron"
    extras = ("megatron",)
    distributed_optimizer = True  # its DistributedOptimizer: Adam's m and v sharded over dp
    no_checkpoints = "megatron-core checkpoints (dist_checkpointing) are not wired into day 28"
    no_recompute = "--recompute is not wired for megatron (its recompute_granularity); use tp_pp"

    def __init__(self, cfg: GPTConfig, r: Recipe, grid: ParallelGrid, device, *,
                 micro_batch: int, seq_len: int, seed: int, steps: int, **_):  # fmt: skip
        import dtl.megatron as dm
        from day22_megatron import mcore

        self.mcore, self.dm, self.r, self.grid, self.cfg = mcore, dm, r, grid, cfg
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self._shim = contextlib.ExitStack()
        dm.init_parallel_state(grid)
        self._shim.enter_context(dm.cpu_shim())
        self.parts = mcore.build(
            cfg, grid, device, optim=r.optim, clip_grad=r.clip, steps=steps,
            distributed_optimizer=True, seed=seed, scheduler=False,
        )  # fmt: skip
        self.forward_step = mcore.make_forward_step(seq_len, device)

    def step(self, micro_batches, lr):
        # the recipe's schedule instead of megatron's OptimizerParamScheduler
        self.mcore.set_lr_and_decay(self.parts, lr, self.r.weight_decay)
        loss, norm = self.mcore.train_step(
            self.parts, self.forward_step, micro_batches, seq_length=self.seq_len,
            micro_batch_size=self.micro_batch,
        )  # fmt: skip
        if self.measure_state:  # after the step: main_grad and Adam's state both still held
            self.last_state = self.mcore.state_bytes(self.parts)
        return loss, float(norm)

    def full_parameters(self):
        from day22_megatron.megatron_gpt import gather_dense

        return _untied(gather_dense(self.parts.chunks, self.cfg, self.grid), self.cfg)

    def close(self):
        self._shim.close()
        self.dm.destroy_parallel_state()


def _untied(state: dict, cfg: GPTConfig) -> dict:
    """A state dict keyed as named_parameters(): a tied lm_head.weight is wte.weight's name."""
    if cfg.tie_weights:
        state.pop("lm_head.weight", None)
    return state


STRATEGIES = tuple(REGISTRY)  # what --strategy takes
MODEL_PARALLEL = tuple(n for n, c in REGISTRY.items() if c.model_parallel)  # take --tp, --pp
# --precision=p is applied by APPLIES[p]; the others run fp32
APPLIES = {p: tuple(n for n, c in REGISTRY.items() if p in c.precisions) for p in PRECISIONS}
COMPILE = tuple(n for n, c in REGISTRY.items() if c.compile)  # wrap in torch.compile


def build(name: str, cfg: GPTConfig, r: Recipe, grid: ParallelGrid, device, *, micro_batch: int,
          accum: int, seq_len: int, seed: int, steps: int,
          recompute: str = "none") -> Strategy:  # fmt: skip
    """The strategy `name` on the one-process GPT(cfg, seed); `grid` is the run's ParallelGrid."""
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(REGISTRY)}")
    return REGISTRY[name](
        cfg, r, grid, device, micro_batch=micro_batch, accum=accum, seq_len=seq_len, seed=seed,
        steps=steps, recompute=recompute,
    )  # fmt: skip


def mean_loss(loss: float | None, grid: ParallelGrid) -> float:
    """The step's loss averaged over the ranks that hold it (the last pipeline stage of every
    DP replica; every rank without a pipeline)."""
    holders = dist.get_world_size() // grid.pp_size
    from dtl.dist import all_reduce_scalar

    return all_reduce_scalar(loss or 0.0) / holders
