"""Run `python -m <module> <args>` in a fork of an interpreter that has imported torch already.

The test suite starts a script ~150 times: every bad-input check, every `--help`, every launch
line's `torchrun`. Each fresh interpreter pays torch's import first (~3 s of one core on the
2-core box CI runs on: ~7 minutes of a 20-minute budget). This server imports torch once; each
run is a fork of it, given the caller's environment, working directory, argv, an empty stdin
and stdout/stderr files of its own, in a session of its own. The day's modules are imported by
the fork, never by the server, so each run starts as a fresh `python -m` would, minus torch's
import. Only the tests use it (dtl.testing.run_script / script_error, and
registry.execute(..., prewarmed=True) for launch lines); `make tour` and readers run the real
commands.

Protocol: one JSON object a line on stdin, {"module", "argv", "env", "cwd", "timeout_s",
"merge"}; one JSON line back, {"code", "stdout", "stderr", "group", "seconds"}. A run past its
timeout gets SIGTERM (torchrun's agent then stops its workers), SIGKILL 15 s later, and code 124.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what every script imports first; the day's own modules are left to each fork
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run")


def _exit_code(e: SystemExit) -> int:
    """The process exit code `python` gives a SystemExit (a message goes to stderr, code 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(case: dict[str, Any], out_path: str, err_path: str, group_path: str) -> None:
    """In the fork: become `python -m module argv` and exit with its code (never returns)."""
    code = 1
    try:
        # exit handlers are the script's own: none of the server's (a weakref.finalize of the
        # server's would delete its temporary folder from here)
        atexit._clear()
        for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]  # private
            finalizer.atexit = False
        os.setsid()  # its own session: a timeout stops it and what it started
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # never the server's command stream
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = out if case["merge"] else os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        # unbuffered, as `python -u`: the run's lines and its children's stay in order
        sys.stdout = io.TextIOWrapper(open(1, "wb", 0), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", 0), write_through=True)
        sys.argv = [case["argv0"], *case["argv"]]
        sys.path[0] = case["cwd"]  # `python -m` puts the working directory first
        sys.modules.pop(case["module"], None)  # preloaded (torchrun): run afresh as __main__
        code = 0
        try:
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
            traceback.print_exc()
            code = 1
        import torch.distributed as dist

        with open(group_path, "w") as f:
            f.write("1" if dist.is_initialized() else "0")
        atexit._run_exitfuncs()
    finally:
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> int:
    """The fork's exit code; past `timeout_s`, SIGTERM to its session, SIGKILL 15 s later: 124."""
    deadline = time.monotonic() + timeout_s
    signals = [(deadline, signal.SIGTERM), (deadline + 15, signal.SIGKILL)]
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return 124 if timed_out else code
        if signals and time.monotonic() > signals[0][0]:
            timed_out = True
            try:
                os.killpg(pid, signals.pop(0)[1])
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Fork, run the case, wait, and return what it printed (the server's loop body)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, name) for name in ("out", "err", "group")]
        sys.stdout.flush(), sys.stderr.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(case, *paths)
        code = _wait(pid, case["timeout_s"])
        return dict(
            code=code,
            stdout=_read(paths[0]),
            stderr=_read(paths[1]),
            group=_read(paths[2]) == "1",
            seconds=time.monotonic() - start,
        )


# --- the client side: what the tests call -----------------------------------------------------


@dataclass
class ScriptRun:
    code: int  # the exit code (124: stopped at its timeout)
    stdout: str  # stdout and stderr together when run with merge=True
    stderr: str
    group: bool  # a process group still existed when the script ended
    seconds: float


_server: subprocess.Popen[str] | None = None


def _server_process() -> subprocess.Popen[str]:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-m", "dtl.script_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
    return _server


def _stop_server() -> None:
    global _server
    if _server is not None:
        _server.kill()
        _server.wait()
        _server = None


def run_script(
    module: str,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str = REPO_ROOT,
    timeout_s: float = 120,
    merge: bool = False,
    argv0: str | None = None,
) -> ScriptRun:
    """`python -m module args` as a fork of the server (started on first use, one per process):
    `env` is the whole environment (default: this process's), `merge` sends stderr to stdout."""
    case = dict(
        module=module,
        argv=list(args),
        argv0=argv0 or module,
        env=dict(env or os.environ),
        cwd=cwd,
        timeout_s=timeout_s,
        merge=merge,
    )
    server = _server_process()
    assert server.stdin is not None and server.stdout is not None  # both are pipes
    try:
        server.stdin.write(json.dumps(case) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
    except BaseException:  # a test's own timeout mid-run: the answer would come to the next caller
        _stop_server()
        raise
    if not line:
        _stop_server()
        raise RuntimeError(f"the script server died running {module} {' '.join(args)}")
    return ScriptRun(**json.loads(line))


atexit.register(_stop_server)


def run_fresh(
    module: str,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str = REPO_ROOT,
    timeout_s: float = 120,
    merge: bool = False,
    argv0: str | None = None,
) -> ScriptRun:
    """run_script's twin in a fresh interpreter (`python -m module args`, a subprocess): what a
    lesson that starts jobs of its own uses; its tests may hand it run_script instead.
    `argv0` is accepted for the same signature (a fresh process names itself)."""
    del argv0
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=dict(env or os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            text=True,
            timeout=timeout_s,
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr or ""
    except subprocess.TimeoutExpired as e:
        code, out, err = 124, _text(e.stdout), _text(e.stderr)
    return ScriptRun(code, out, err, False, time.monotonic() - start)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_case(json.loads(line))), flush=True)


if __name__ == "__main__":
    serve()
