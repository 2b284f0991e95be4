"""Day 21: train the shared GPT with context parallelism (and TP + SP, and DP beside them).

CPU (gloo), ~7 s at 2 ranks, ~12 s at 4:
    torchrun --standalone --nproc_per_node=2 -m day21_sp_cp.train --cp=2 --attn=ring_zigzag
    torchrun --standalone --nproc_per_node=4 -m day21_sp_cp.train --cp=2 --tp=2 --sp  # CP x TP+SP
    torchrun --standalone --nproc_per_node=4 -m day21_sp_cp.train --cp=2 --attn=ulysses  # CP x DP
    torchrun --standalone --nproc_per_node=2 -m day21_sp_cp.train --cp=1 --tp=2 --sp     # SP only
GPUs (NCCL):
    torchrun --standalone --nproc_per_node=gpu -m day21_sp_cp.train --cp=2 \
        --config day21_sp_cp/gpu.toml

Environment: OMP_NUM_THREADS=1 (torchrun's default; ranks share 2 cores here).

The grid is ParallelGrid(dp, cp, tp) with dp = world / (cp·tp). Every rank of a dp index reads the
same rows; each cp rank keeps its T/cp tokens (contiguous or zig-zag) and their position ids;
gradients are averaged over dp x cp by DDP. Before training, one layer's saved activations are
measured beside the formula; each step prints the loss and the bytes sent by attention over cp
and by TP/SP, beside the formulas; at the end rank 0 trains the dense model in one process on
the global batch and compares losses and parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from day19_tp.activations import saved_activation_bytes
from day19_tp.tp import TPError, apply_tp, check_tp, full_tensors, tp_loss
from day21_sp_cp import formulas
from day21_sp_cp.cp import ATTENTION, CPError, apply_cp, check_cp, cp_batch
from day21_sp_cp.sp import apply_sp
from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl import profile as dtl_profile
from dtl.comm import CommCounter
from dtl.data import get_batch, load_corpus, tokenizer_for
from dtl.grid import ParallelGrid
from dtl.metrics import StepLogger, matches_formula
from dtl.model import GPT, PresetName, loss_fn, preset
from dtl.reference import Verdict, dense_verdict

MB = 1e6
CP_KINDS = ("send", "all_to_all")  # ring attention's p2p, Ulysses' all-to-alls: the cp group
TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # TP and SP: the tp group


@dataclass
class Config:
    cp: int = 2  # context-parallel size: ranks that split each sequence
    attn: str = "ring_zigzag"  # ring (contiguous split) | ring_zigzag | ulysses
    tp: int = 1  # tensor-parallel size; dp = world / (cp * tp)
    sp: bool = False  # Megatron sequence parallelism on top of TP (needs tp > 1)
    pad_vocab: bool = False  # TP: pad the vocabulary to a multiple of tp (GPT-2's 50,257)
    save_gathered: bool = False  # SP: keep the all-gathered input for backward (no re-gather)
    model: PresetName = "small"  # GPT preset (`small`: 4 layers, 4 heads, n_embd 128, block 128)
    batch_size: int = 2  # sequences per DP rank
    seq_len: int = 128  # tokens per sequence (split over cp, then over tp under SP)
    steps: int = 4  # optimizer steps
    lr: float = 1e-3  # AdamW learning rate
    check: bool = True  # rank 0 trains the dense model in one process and compares
    seed: int = 0  # model init and batches
    out_dir: str = ""  # empty: outputs/day21_sp_cp/<attn>-cp<cp>-tp<tp>[-sp]-dp<dp>

    def validate(self) -> None:
        err = dtl_config.ConfigError
        world = dtl_dist.launch_world_size()
        if world % (self.cp * self.tp):
            raise err(f"cp {self.cp} x tp {self.tp} does not divide the world size {world}")
        if self.sp and self.tp == 1:
            raise err(
                "--sp needs tensor parallelism: sequence parallelism splits TP's "
                "replicated activations, so set --tp > 1"
            )
        cfg = preset(self.model)
        if self.seq_len > cfg.block_size:
            raise err(f"seq_len {self.seq_len} exceeds {self.model}'s block_size {cfg.block_size}")
        try:
            check_tp(cfg, self.tp, self.pad_vocab)
            check_cp(cfg.n_head, self.tp, self.cp, self.seq_len, self.attn, self.sp)
        except (TPError, CPError) as e:
            raise err(str(e)) from None
        dp = world // (self.cp * self.tp)
        sp = "-sp" if self.sp else ""
        self.out_dir = (
            self.out_dir or f"outputs/day21_sp_cp/{self.attn}-cp{self.cp}-tp{self.tp}{sp}-dp{dp}"
        )


def build(cfg: Config, grid: ParallelGrid, device):
    gpt = GPT(preset(cfg.model), seed=cfg.seed)
    if cfg.tp > 1:
        apply_tp(gpt, grid, pad_vocab=cfg.pad_vocab)
    if cfg.sp:
        apply_sp(gpt, save_gathered=cfg.save_gathered)
    apply_cp(gpt, grid, cfg.attn)  # cp = 1: keeps the fused kernel, only sets model.cp
    gpt = gpt.to(device)
    group = grid.group("dp", "cp")
    model = DDP(gpt, process_group=group) if grid.dp_size * grid.cp_size > 1 else gpt
    return gpt, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def measure_activations(cfg: Config, gpt: GPT, grid: ParallelGrid, device) -> tuple[int, float]:
    """Bytes block 0 saves for backward on this rank, and the formula's figure."""
    mcfg = preset(cfg.model)
    tokens = cfg.seq_len // cfg.cp // (cfg.tp if cfg.sp else 1)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_size, tokens, mcfg.n_embd, generator=g).to(device).requires_grad_()
    got, _ = saved_activation_bytes(gpt.blocks["0"], x)
    attention = "ulysses" if cfg.attn == "ulysses" and cfg.cp > 1 else "fused"
    want = formulas.layer_terms(
        cfg.seq_len,
        cfg.batch_size,
        mcfg.n_embd,
        mcfg.n_head,
        t=cfg.tp,
        cp=cfg.cp,
        sp=cfg.sp,
        attention=attention,
        save_gathered=cfg.save_gathered,
    )
    return got, sum(want.values())


def predicted_bytes(cfg: Config) -> dict[str, float]:
    """One step's bytes per rank, by group, from formulas.py."""
    mcfg = preset(cfg.model)
    b, s, h, L = cfg.batch_size, cfg.seq_len, mcfg.n_embd, mcfg.n_layer
    out = {"cp": 0.0, "tp": 0.0}
    if cfg.cp > 1:
        per = (
            formulas.ulysses_layer_bytes if cfg.attn == "ulysses" else formulas.ring_layer_bytes
        )(b, s, h, cfg.cp, cfg.tp)
        out["cp"] = L * sum(per.values())
    if cfg.sp:
        out["tp"] = sum(
            formulas.sp_step_bytes(mcfg, b, s // cfg.cp, cfg.tp, 4, cfg.save_gathered).values()
        )
    elif cfg.tp > 1:
        out["tp"] = formulas.tp_step_bytes(mcfg, b, s // cfg.cp, cfg.tp)
    return out


def run(cfg: Config, info, grid: ParallelGrid) -> dict:
    mcfg = preset(cfg.model)
    corpus = load_corpus(tokenizer=tokenizer_for(mcfg.vocab_size))
    gpt, model, opt = build(cfg, grid, info.device)
    act = measure_activations(cfg, gpt, grid, info.device)
    log = StepLogger(
        cfg.out_dir, cfg.steps, tokens_per_step=cfg.batch_size * cfg.seq_len * grid.dp_size
    )
    losses = []
    for step in range(cfg.steps):
        x, y = get_batch(
            corpus.train,
            cfg.seq_len,
            cfg.batch_size,
            seed=cfg.seed,
            step=step,
            dp_rank=grid.dp_rank,
            dp_size=grid.dp_size,
        )
        x, y, pos = cp_batch(gpt, x.to(info.device), y.to(info.device))  # my T/cp tokens
        t0 = time.perf_counter()
        with dtl_profile.range(dtl_profile.STEP):  # the step's named ranges (dtl.profile)
            with CommCounter() as comm:  # every group; the kinds tell cp from tp (module top)
                with dtl_profile.range(dtl_profile.FORWARD):
                    logits = model(x, pos)
                    loss = tp_loss(gpt, logits, y) if cfg.tp > 1 else loss_fn(logits, y)
                with dtl_profile.range(dtl_profile.BACKWARD):
                    loss.backward()
            with dtl_profile.range(dtl_profile.OPTIMIZER):
                opt.step()
        opt.zero_grad(set_to_none=True)
        if info.device.type == "cuda":  # the step's kernels, not only their launch
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        losses.append(dtl_dist.all_reduce_scalar(loss.item(), grid.group("dp", "cp"), average=True))
        sent = {
            "cp": sum(comm.ring_bytes_per_rank(k) for k in CP_KINDS if k in comm.calls),
            "tp": sum(comm.ring_bytes_per_rank(k) for k in TP_KINDS if k in comm.calls),
        }
        log.log(
            step,
            loss=losses[-1],
            dt_s=dt,
            cp_comm_mb=f"{sent['cp'] / MB:.3f}",
            tp_comm_mb=f"{sent['tp'] / MB:.3f}",
        )
    log.close()
    full = full_tensors(gpt) if cfg.tp > 1 else {n: p.detach() for n, p in gpt.named_parameters()}
    return dict(losses=losses, sent=sent, act=act, corpus=corpus, full=full)


def report(cfg: Config, info, grid: ParallelGrid, result: dict) -> bool:
    got_act, want_act = result["act"]
    act_err = abs(got_act - want_act) / want_act
    dtl_dist.print0(
        f"activations saved by one layer on rank 0: {got_act / MB:.3f} MB measured, "
        f"{want_act / MB:.3f} MB formula ({act_err:.1%} apart; day21_sp_cp/formulas.py layer_terms)"
    )
    want = predicted_bytes(cfg)
    got = result["sent"]
    for axis, what in (
        ("cp", f"attention over cp ({cfg.attn})"),
        ("tp", "TP + SP" if cfg.sp else "TP"),
    ):
        if want[axis] or got[axis]:
            dtl_dist.print0(
                f"bytes sent per rank per step by {what}: {got[axis] / MB:.3f} MB measured, "
                f"{want[axis] / MB:.3f} MB formula "
                f"({'exact' if matches_formula(got[axis], want[axis]) else 'MISMATCH'})"
            )
    comm_ok = all(matches_formula(got[a], want[a]) for a in want)
    verdict = _compare(cfg, info, grid, result)
    ok = verdict.ok and comm_ok and got_act == want_act  # saved activations: to the byte
    dtl_dist.print0(
        f"summary: day21 attn={cfg.attn} cp={cfg.cp} tp={cfg.tp} sp={str(cfg.sp).lower()} "
        f"dp={grid.dp_size} model={cfg.model}: {verdict}; comm = formula "
        f"{'yes' if comm_ok else 'NO'}; activations/layer {got_act / MB:.3f} MB vs formula "
        f"{want_act / MB:.3f} MB ({act_err:.1%})"
    )
    return ok


def _compare(cfg: Config, info, grid: ParallelGrid, result: dict) -> Verdict:
    """rank 0 trains the dense model in one process on the global batch (dtl.reference)."""
    return dense_verdict(
        result["losses"],
        result["full"],
        preset(cfg.model),
        result["corpus"].train,
        seq_len=cfg.seq_len,
        rows=cfg.batch_size * grid.dp_size,
        steps=cfg.steps,
        device=info.device,
        check=cfg.check,
        seed=cfg.seed,
        lr=cfg.lr,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)  # bad input: one line, exit 2, before any collective
    info = dtl_dist.init()
    grid = ParallelGrid(cp=cfg.cp, tp=cfg.tp, dp=info.world_size // (cfg.cp * cfg.tp))
    dtl_config.save(cfg, cfg.out_dir, argv)
    split = f"; {ATTENTION[cfg.attn]} split" if cfg.cp > 1 else ""
    dtl_dist.print0(f"grid: {grid}{split}")
    result = run(cfg, info, grid)
    dtl_dist.finish(report(cfg, info, grid, result))  # cleanup; exit 1 if a check failed


if __name__ == "__main__":
    main()
