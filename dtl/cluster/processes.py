"""Processes by pid: signal one, ask whether it still runs, stop a list of them."""

from __future__ import annotations

import os
import signal
import time


def send_signal(pid: int, sig: signal.Signals) -> None:
    """Signal pid if it still exists."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """Is pid running? A child of ours that ended is reaped here; a zombie counts as ended."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not our child: the kernel's table says
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state after the name
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop(pids: list[int], grace: float = 5) -> None:
    """SIGTERM, newest first (a daemon started last depends on those before it); SIGKILL what
    is left after `grace` seconds; wait until all have ended."""
    for pid in reversed(pids):
        send_signal(pid, signal.SIGTERM)
    wait_gone(pids, grace)
    for pid in pids:
        send_signal(pid, signal.SIGKILL)
    wait_gone(pids, grace)
