"""Day 24: fault drills. Each one runs train.py under torchrun, breaks something, and checks
that the run recovered to exactly where an uninterrupted run ends.

    torchrun --standalone --nproc_per_node=1 -m day24_checkpoint.drill --drill=all --repeats=10
    python -m day24_checkpoint.drill --drill=kill_rank    # also fine without the outer torchrun

kill_rank         SIGKILL one rank before a random step under `torchrun --max-restarts=1`: torchrun
                  stops the others and restarts all; they resume from the last committed
                  checkpoint. Verdict: the losses of every step and the final parameters'
                  sha256 equal the uninterrupted run's, bit for bit; the restart overhead is
                  the time from the kill to the first resumed step's record.
kill_during_save  SIGKILL one rank after it wrote its shard of a checkpoint, before the commit:
                  the half-written step_N.tmp is never loaded; the run resumes from the one
                  before, and still ends bit-identical.
corrupt_shard     flip one byte of a committed shard, then delete one: `--resume=latest` must
                  stop with one line naming the file (exit 2), never load it.
elastic           two torchrun agents (--nnodes=2, c10d rendezvous on localhost) train together
                  and end bit-identical to one agent with 2 processes; then --nnodes=1:2: one
                  agent starts alone, the second joins after the first checkpoint, the workers
                  restart at world 2 and resume from it.

The drill itself is an orchestrator: launched by torchrun (like every lesson line) it runs as one
process and starts its own torchrun jobs, with the outer torchrun's variables removed and
DTL_BACKEND=gloo (FORCED_BACKEND: on a GPU machine too, and it says so in a `note:` line).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch

from dtl import config as dtl_config
from dtl import dist as dtl_dist
from dtl.registry import child_env
from dtl.script_server import run_fresh

DRILLS = ("kill_rank", "kill_during_save", "corrupt_shard", "elastic")
BACKENDS = ("gloo", "auto")


@dataclass
class Config:
    # kill_rank | kill_during_save | corrupt_shard | elastic | all
    drill: Literal[(*DRILLS, "all")] = "all"
    repeats: int = 1  # kill_rank drills (each kills before another step)
    nproc: int = 2  # processes per job
    parallel: str = "ddp"  # ddp | fsdp2 | tp
    steps: int = 12  # steps per run
    save_every: int = 4  # steps between checkpoints
    seed: int = 0  # which steps the kills land on
    # gloo: every job on the CPU, on any machine (the default: see FORCED_BACKEND); auto: each
    # job chooses as train.py does (NCCL when every rank has a GPU): a GPU's save and resume
    backend: Literal[BACKENDS] = "gloo"
    out_dir: str = "outputs/day24_checkpoint/drills"  # one folder per run, wiped first

    def validate(self) -> None:
        if self.backend == "auto" and self.drill in ("elastic", "all"):
            raise dtl_config.ConfigError(
                "the elastic drill needs backend=gloo: its one-process agents would all take "
                "cuda:0, which NCCL refuses"
            )
        if self.steps <= self.save_every + 1:
            raise dtl_config.ConfigError(
                "steps must exceed save_every + 1 (a kill needs a "
                "checkpoint behind it and a step after it)"
            )


@dataclass
class Run:
    returncode: int
    output: str
    out_dir: str
    seconds: float

    @property
    def sha(self) -> str | None:
        m = re.search(r"final params sha256 ([0-9a-f]+)", self.output)
        return m.group(1) if m else None

    @property
    def resumed_from(self) -> int | None:
        m = re.findall(r"resumed from \S+ \(step (\d+)\)", self.output)
        return int(m[-1]) if m else None

    def losses(self) -> dict[int, str]:
        """step -> the loss of the last attempt that ran it (hex)."""
        out = {}
        with open(os.path.join(self.out_dir, "losses.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
        return out

    def records(self) -> list[dict]:
        with open(os.path.join(self.out_dir, "losses.jsonl")) as f:
            return [json.loads(line) for line in f]


# By default every job the drills start runs gloo on the CPU. The drills test recovery, not
# speed, and the elastic drill starts several agents of one process each on one machine: under
# NCCL every one of them would take cuda:0 (LOCAL_RANK 0 in each agent), which NCCL refuses; and
# a bit-identical verdict needs every run of a drill on the same backend. --backend=auto lets
# the other drills run as train.py chooses: on GPUs, a save and resume through CUDA and NCCL.
FORCED_BACKEND = "gloo"


def clean_env(backend: str = FORCED_BACKEND, **extra) -> dict:
    # the parent torchrun's variables removed (dtl.registry), the drills' backend forced
    forced = {"DTL_BACKEND": FORCED_BACKEND} if backend == FORCED_BACKEND else {}
    return child_env(**forced, **extra)


class Drills:
    """The drills of one Config. `run_module` starts `python -m <module> <args>` and returns a
    dtl.script_server.ScriptRun: a fresh interpreter by default (run_fresh); the tests hand it
    run_script, the same job forked from an interpreter that imported torch already."""

    def __init__(self, cfg: Config, run_module=run_fresh):
        self.cfg, self.run_module = cfg, run_module
        self.common = [
            f"--parallel={cfg.parallel}",
            f"--steps={cfg.steps}",
            f"--save_every={cfg.save_every}",
            "--resume=auto",
            f"--fail_rank={cfg.nproc - 1}",  # the last rank dies (rank 0 when there is one)
        ]
        self.standalone = ["--standalone", f"--nproc_per_node={cfg.nproc}"]
        self.env = clean_env(cfg.backend)
        self._reference: Run | None = None

    def path(self, name: str) -> str:
        return os.path.join(self.cfg.out_dir, name)

    def torchrun(self, launch: list[str], train: list[str], out_dir: str, timeout_s=180) -> Run:
        """Run `torchrun <launch> -m day24_checkpoint.train <train>` into a fresh out_dir."""
        shutil.rmtree(out_dir, ignore_errors=True)
        args = [*launch, "-m", "day24_checkpoint.train", f"--out_dir={out_dir}", *train]
        t0 = time.perf_counter()
        done = self.run_module(
            "torch.distributed.run", *args, env=self.env, timeout_s=timeout_s, argv0="torchrun"
        )
        return Run(done.code, done.stdout + done.stderr, out_dir, time.perf_counter() - t0)

    def reference(self) -> Run:
        """The uninterrupted run every drill is compared with (run once)."""
        if self._reference is None:
            self._reference = self.torchrun(self.standalone, self.common, self.path("reference"))
            if self._reference.returncode != 0 or self._reference.sha is None:
                raise RuntimeError(f"the reference run failed:\n{self._reference.output[-2000:]}")
        return self._reference

    def same_as_reference(self, run: Run) -> bool:
        ref = self.reference()
        return run.sha == ref.sha and run.losses() == ref.losses()

    # --- the drills --------------------------------------------------------------------------
    def kill_rank(self, step: int) -> dict:
        run = self.torchrun(
            [*self.standalone, "--max-restarts=1"],
            [*self.common, f"--fail_at_step={step}"],
            self.path(f"kill_rank_{step}"),
        )
        expected = step // self.cfg.save_every * self.cfg.save_every
        return dict(
            drill="kill_rank",
            step=step,
            ok=run.returncode == 0 and run.resumed_from == expected and self.same_as_reference(run),
            resumed_from=run.resumed_from,
            expected_resume=expected,
            restart_s=_restart_overhead(run),
            seconds=run.seconds,
            tail=run.output[-1500:],
        )

    def kill_during_save(self) -> dict:
        step = 2 * self.cfg.save_every  # the second checkpoint: the first one must be loaded
        run = self.torchrun(
            [*self.standalone, "--max-restarts=1"],
            [*self.common, f"--fail_during_save={step}"],
            self.path("kill_during_save"),
        )
        expected = step - self.cfg.save_every
        return dict(
            drill="kill_during_save",
            step=step,
            ok=run.returncode == 0 and run.resumed_from == expected and self.same_as_reference(run),
            resumed_from=run.resumed_from,
            expected_resume=expected,
            seconds=run.seconds,
            tail=run.output[-1500:],
        )

    def corrupt_shard(self) -> dict:
        from day24_checkpoint.ckpt import latest

        ref = self.reference()
        results = {}
        for damage in ("flip a byte", "delete"):
            root = self.path(f"corrupt_{damage.split()[0]}")
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(ref.out_dir, root)
            last = self.cfg.nproc - 1  # the last rank's shard
            shard = os.path.join(latest(os.path.join(root, "ckpt")), f"__{last}_0.distcp")
            if damage == "delete":
                os.remove(shard)
            else:
                with open(shard, "r+b") as f:
                    f.seek(os.path.getsize(shard) // 2)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
            proc = self.run_module(
                "day24_checkpoint.train",
                f"--out_dir={root}",
                *self.common[:3],
                "--resume=latest",
                env=self.env,
                timeout_s=120,
            )
            lines = proc.stderr.strip().splitlines()
            results[damage] = dict(
                code=proc.code,
                line=lines[-1] if lines else "",
                one_line=len(lines) == 1,
                names_file=shard in proc.stderr,
            )
        ok = all(r["code"] == 2 and r["one_line"] and r["names_file"] for r in results.values())
        return dict(drill="corrupt_shard", ok=ok, results=results)

    def elastic(self) -> dict:
        # torch 2.13's agents share one TCPStore between rendezvous rounds by default; when a
        # node joins a running job that path leaves the newcomer waiting for a master address
        # the old rank 0 never writes (the notes show the stacks). Turning sharing off fixes it.
        env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        two = self._agents(2, "2", self.path("elastic_two"), env, join_after_ckpt=False)
        grow = self._agents(2, "1:2", self.path("elastic_grow"), env, join_after_ckpt=True)
        worlds = [r["world"] for r in grow["run"].records()] if grow["run"].returncode == 0 else []
        grew = bool(worlds) and worlds[0] == 1 and worlds[-1] == 2
        ok = (
            two["run"].returncode == 0
            and self.same_as_reference(two["run"])
            and grow["run"].returncode == 0
            and grew
            and grow["run"].resumed_from is not None
        )
        return dict(
            drill="elastic",
            ok=ok,
            two_agents_identical=self.same_as_reference(two["run"]),
            grew=grew,
            resumed_from=grow["run"].resumed_from,
            seconds=two["run"].seconds + grow["run"].seconds,
            tail=two["run"].output[-800:] + grow["run"].output[-800:],
        )

    def _agents(self, n: int, nnodes: str, out_dir: str, env, join_after_ckpt: bool) -> dict:
        shutil.rmtree(out_dir, ignore_errors=True)
        port = 29400 + random.Random(out_dir).randrange(500)
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=localhost:{port}",
            f"--rdzv_id={os.path.basename(out_dir)}",
            "--rdzv_conf=last_call_timeout=1",
            "--max-restarts=3",
            "--monitor-interval=0.2",
            "-m",
            "day24_checkpoint.train",
            f"--out_dir={out_dir}",
            *self.common,
        ]
        if join_after_ckpt:  # alone, the first agent's worker waits after its first save
            launch.append(f"--hold_at_step={self.cfg.save_every}")
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(
                launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        ]
        if join_after_ckpt:
            pointer = os.path.join(out_dir, "ckpt", "latest")
            while not os.path.exists(pointer) and time.perf_counter() - t0 < 60:
                time.sleep(0.1)
        procs += [
            subprocess.Popen(
                launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            for _ in range(n - 1)
        ]
        outputs, codes = [], []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append(out)
            codes.append(p.returncode)
        code = max(codes, key=abs)
        return dict(run=Run(code, "\n".join(outputs), out_dir, time.perf_counter() - t0))


def _restart_overhead(run: Run) -> float | None:
    """Seconds from the SIGKILL to the first step the restarted workers recorded."""
    m = re.search(r"SIGKILL at t=([\d.]+)", run.output)
    resumed = [r["time"] for r in run.records() if r["attempt"] > 0] if m else []
    return resumed[0] - float(m.group(1)) if resumed else None


def main(argv: list[str] | None = None) -> None:
    cfg = dtl_config.parse(Config, argv)
    if dtl_dist.launch_world_size() != 1:
        dtl_config.exit_with_error("drill.py is one orchestrating process: --nproc_per_node=1")
    if cfg.backend == "auto":
        print("note: each drill job chooses its backend as train.py does (NCCL on GPUs)")
    elif torch.cuda.is_available():  # a GPU machine: say that this PASS is no GPU result
        print(
            f"note: {FORCED_BACKEND} on the CPU (forced: DTL_BACKEND={FORCED_BACKEND} for every "
            "drill job, whose one-process agents would all take cuda:0 under NCCL); this PASS "
            "is not a GPU result",
            flush=True,
        )
    drills = Drills(cfg)
    chosen = DRILLS if cfg.drill == "all" else (cfg.drill,)
    rng = random.Random(cfg.seed)
    results = []
    ref = drills.reference()
    print(
        f"reference: {cfg.nproc} ranks, {cfg.steps} steps, {cfg.parallel}: sha256 {ref.sha}, "
        f"{ref.seconds:.1f} s",
        flush=True,
    )
    for name in chosen:
        for _ in range(cfg.repeats if name == "kill_rank" else 1):
            if name == "kill_rank":
                results.append(drills.kill_rank(rng.randrange(cfg.save_every + 1, cfg.steps)))
            else:
                results.append(getattr(drills, name)())
            _print(results[-1])
    passed = sum(r["ok"] for r in results)
    overheads = [r["restart_s"] for r in results if r.get("restart_s") is not None]
    extra = f"; restart overhead {min(overheads):.1f}-{max(overheads):.1f} s" if overheads else ""
    print(
        f"summary: day24 drills {','.join(chosen)}: {passed}/{len(results)} recovered exactly "
        f"(bit-identical to the uninterrupted run, or refused with one line){extra}",
        flush=True,
    )
    if passed != len(results):
        raise SystemExit(1)


def _print(r: dict) -> None:
    keys = [k for k in r if k not in ("tail", "drill", "ok")]
    detail = ", ".join(
        f"{k}={r[k]:.2f}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys
    )
    print(f"{r['drill']}: {'OK' if r['ok'] else 'FAILED'} ({detail})", flush=True)
    if not r["ok"] and "tail" in r:
        print(r["tail"], flush=True)


if __name__ == "__main__":
    main()
