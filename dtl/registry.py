"""The lesson registry: `lessons.toml` is the one place launch lines are written.

The README's map and docs/lessons.md (`python -m dtl.course_map --write`), the tour
(`python -m dtl.tour`) and `tests/test_lessons.py` all read it, so a documented launch line is a
tested launch line.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from dtl import extras as dtl_extras
from dtl import script_server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGISTRY = os.path.join(REPO_ROOT, "lessons.toml")
KINDS = ("lesson", "benchmark")
IDEA_CHARS = 80  # a day's idea is one short line of the README's map
# A run that cannot run here (a GPU-only lesson on a CPU box) prints one line starting with this
# and exits 0: the tour and the tests then show SKIP with its reason, never PASS.
SKIP_PREFIX = "skipped:"
# the overrides a lesson line's smoke_args may make: how much it computes, never what
SIZE_KEYS = (
    "model",
    "seq_len",
    "steps",
    "epochs",
    "reps",
    "iters",
    "micro_batch_size",
    "vocab_size",
    "max_bytes",
    "models",
    "fit_budget_gb",
    "seqs",
    "train_iters",
)


@dataclass
class Run:
    name: str
    cpu: str  # the CPU launch line, exactly as a reader types it
    gpu: str
    expect: list[str]  # regexes the run's output must match, each on some line
    timeout_s: int = 180
    # "lesson": run by `make tour` as written. "benchmark": a long measurement; `make tour`
    # skips it (python -m dtl.tour --benchmarks runs it).
    kind: str = "lesson"
    # What the tests append to shrink the run (config overrides come last, so they shrink the
    # same script on the same code path): a benchmark must have them; a lesson line may, with
    # sizes only (SIZE_KEYS), where its full size costs the suite's budget and a unit test checks
    # the same claim. `make tour` runs every lesson line as written.
    smoke_args: str = ""
    # GPUs the GPU line needs: `make gpu-all` shows SKIP for it on a machine with fewer
    min_gpus: int = 1
    # the GPU line's limit, where it differs: a line sized for 8 GPUs may run on one
    gpu_timeout_s: int | None = None
    # the GPU line's patterns, where they differ (a GPU config that turns the one-process check
    # off may print "check skipped"; on the CPU the check must have run): default `expect`
    gpu_expect: list[str] | None = None
    # a run whose module lives in another day's package, registered here on purpose (a later
    # day re-running an earlier one's script): without it such a run is refused, so a line
    # pasted under the wrong day (and run twice by the tour) fails at load time
    cross_day: bool = False
    # the optional extras (pyproject's optional-dependencies) the line needs: without one the
    # run is a SKIP that names it, as the script itself stops in one line saying so
    extras: list[str] = field(default_factory=list)

    def patterns(self, gpu: bool) -> list[str]:
        return self.gpu_expect if gpu and self.gpu_expect is not None else self.expect

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"lessons.toml run '{self.name}': kind must be one of {KINDS}")
        if not isinstance(self.min_gpus, int) or self.min_gpus < 1:
            raise ValueError(f"lessons.toml run '{self.name}': min_gpus must be an integer >= 1")
        unknown = set(self.extras) - set(dtl_extras.EXTRA_MODULES)
        if unknown:
            raise ValueError(f"lessons.toml run '{self.name}': unknown extras {sorted(unknown)}")


def launched_package(line: str) -> str:
    """The top-level package of the module a launch line starts (`-m pkg.mod`, or a script's
    path `pkg/script.py`); "" when the line names neither."""
    words = shlex.split(line)
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].split(".")[0]
    scripts = [w for w in words if w.endswith(".py")]
    return os.path.normpath(scripts[0]).split(os.sep)[0] if scripts else ""


@dataclass
class Lesson:
    day: int
    package: str
    title: str
    idea: str  # the day in one line, for the README's map
    proves: str
    runs: list[Run] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.idea) > IDEA_CHARS:
            raise ValueError(f"lessons.toml day {self.day}: idea is over {IDEA_CHARS} characters")
        for run in self.runs:
            for line in (run.cpu, run.gpu):
                launched = launched_package(line)
                if launched != self.package and not run.cross_day:
                    raise ValueError(
                        f"lessons.toml run '{run.name}' of day {self.day} launches "
                        f"{launched or 'no module'}, outside {self.package}: register it under "
                        "its own day, or mark it cross_day = true"
                    )


def load(path: str = REGISTRY) -> list[Lesson]:
    with open(path, "rb") as f:
        table = tomllib.load(f)
    lessons = []
    for entry in table["lesson"]:
        runs = [Run(**r) for r in entry.pop("run")]
        lessons.append(Lesson(**entry, runs=runs))
    return sorted(lessons, key=lambda lesson: lesson.day)


# --- running a launch line -------------------------------------------------------------------


@dataclass
class Result:
    lesson: Lesson
    run: Run
    returncode: int
    seconds: float
    output: str
    missing: list[str]  # expect patterns not found

    @property
    def skip_reason(self) -> str | None:
        """Why the run skipped itself (its `skipped:` line), if it exited 0 saying so."""
        if self.returncode != 0:
            return None
        lines = [ln for ln in self.output.splitlines() if ln.startswith(SKIP_PREFIX)]
        return lines[0].removeprefix(SKIP_PREFIX).strip() if lines else None

    @property
    def status(self) -> str:
        """PASS, FAIL or SKIP: a skip is neither a pass nor a failure."""
        if self.skip_reason is not None:
            return "SKIP"
        return "PASS" if self.returncode == 0 and not self.missing else "FAIL"

    @property
    def ok(self) -> bool:
        """Not a failure (PASS or SKIP)."""
        return self.status != "FAIL"

    def summary_lines(self) -> list[str]:
        if self.skip_reason is not None:
            return [f"summary: skipped: {self.skip_reason}"]
        return [line for line in self.output.splitlines() if line.startswith("summary:")]


def skipped(lesson: Lesson, run: Run, reason: str) -> Result:
    """A run not started at all (e.g. it needs more GPUs than present), as a SKIP result."""
    return Result(lesson, run, 0, 0.0, f"{SKIP_PREFIX} {reason}\n", [])


def use_venv_tools(env: MutableMapping[str, str]) -> None:
    """Point `env` (a dict, or os.environ) at this venv's tools and DeepSpeed's prebuilt ops.

    Its bin first on PATH: the venv's ninja (1.13) built DeepSpeed's ops at install
    (tools/warm_deepspeed_ops.py), and another ninja version cannot read its build log and
    rebuilds every op (measured: ~90 s inside the first DeepSpeed test). TORCH_EXTENSIONS_DIR:
    where those ops are, unless set. Used by launch lines, the tests and the build script alike.
    """
    venv_bin = os.path.dirname(sys.executable)
    if env.get("PATH", "").split(os.pathsep)[0] != venv_bin:
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def run_env() -> dict[str, str]:
    """The environment a launch line runs in: this venv's tools, offline HF, 1 thread."""
    env = dict(os.environ)
    use_venv_tools(env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# what torchrun puts in a worker's environment: a job a worker starts must not inherit it, or the
# child's torchrun/init_process_group would join the parent's job
TORCHRUN_VARS = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_\w+|ROLE_\w+|MASTER_ADDR|MASTER_PORT|"
    r"TORCHELASTIC_\w+|TORCH_NCCL_ASYNC\w*)$"
)


def child_env(**extra: str) -> dict[str, str]:
    """run_env() for a torchrun job started from inside another one (drills, profilers): the
    parent's torchrun variables removed, `extra` added."""
    env = {k: v for k, v in run_env().items() if not TORCHRUN_VARS.match(k)}
    env.update(extra)
    return env


def execute(
    lesson: Lesson, run: Run, gpu: bool = False, extra_args: str = "", prewarmed: bool = False
) -> Result:
    """Run the launch line (with `extra_args` appended) under its time limit.

    `prewarmed` (the tests): torchrun runs as a fork of dtl.script_server's interpreter, which
    has imported torch already, instead of a fresh `torchrun` process: the same program
    (torch.distributed.run, torchrun's entry point) with the same arguments and environment,
    ~3 s sooner. Its workers are fresh processes either way."""
    absent = dtl_extras.missing(run.extras)
    if absent:
        return skipped(lesson, run, dtl_extras.skip_reason(absent))
    line = (run.gpu if gpu else run.cpu) + (f" {extra_args}" if extra_args else "")
    limit = (run.gpu_timeout_s or run.timeout_s) if gpu else run.timeout_s
    words = shlex.split(line)
    start = time.monotonic()
    if prewarmed and words[0] == "torchrun":
        done = script_server.run_script(
            "torch.distributed.run",
            *words[1:],
            argv0="torchrun",
            env=run_env(),
            cwd=REPO_ROOT,
            timeout_s=limit,
            merge=True,
        )
        output, code = done.stdout, done.code
    else:
        output, code = _launch(line, limit)
    if code == 124:
        output += f"\n[timed out after {limit} s]"
    seconds = time.monotonic() - start
    missing = [p for p in run.patterns(gpu) if not re.search(p, output, re.M)]
    return Result(lesson, run, code, seconds, output, missing)


def _launch(line: str, limit: float) -> tuple[str, int]:
    """The launch line as a shell command: what it printed and its exit code (124: timed out)."""
    proc = subprocess.Popen(
        line,
        shell=True,
        cwd=REPO_ROOT,
        env=run_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=limit)
        return output, proc.returncode
    except subprocess.TimeoutExpired:
        return _stop(proc), 124


def _stop(proc: subprocess.Popen[str]) -> str:
    """End a launch line that ran too long, workers included, and return what it printed.

    torchrun starts its workers in sessions of their own: killing torchrun alone would orphan
    them. SIGTERM lets its agent stop the workers; whatever is left is killed after 15 s.
    """
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return output or ""
