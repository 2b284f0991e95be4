"""The course's optional Python extras (pyproject.toml's optional-dependencies): which are
installed, and the one-line stop a script gives when a run needs one that is not.

    extras.missing(["deepspeed"])          # [] when DeepSpeed is importable
    extras.require("part=ratio", "megatron")  # ConfigError in one line, before any process group

Three readers ask this: a script's Config.validate (bad input stops in one line), the registry
(a launch line that needs an absent extra is a SKIP, not a failure), and the tests
(dtl.testing.needs_extras). Finding a module's spec imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from dtl.config import ConfigError

# extra (as `pip install -e '.[extra]'` names it) -> the module it installs
EXTRA_MODULES = {"deepspeed": "deepspeed", "megatron": "megatron.core"}
MISSING_EXTRA = "missing extra"  # every skip for an absent extra says this (tests/conftest.py)


def installed(module: str) -> bool:
    """`module` importable (find_spec of a dotted name needs its parent package to exist)."""
    parent = module.split(".")[0]
    return importlib.util.find_spec(parent) is not None and (
        importlib.util.find_spec(module) is not None
    )


def missing(extras: Iterable[str]) -> list[str]:
    """The extras of `extras` that are not installed, in order."""
    unknown = [e for e in extras if e not in EXTRA_MODULES]
    if unknown:
        raise ValueError(f"unknown extra(s) {unknown}: the course's are {sorted(EXTRA_MODULES)}")
    return [e for e in extras if not installed(EXTRA_MODULES[e])]


def install_hint(extras: Iterable[str]) -> str:
    return f"pip install -e '.[{','.join(extras)}]'"


def require(what: str, *extras: str, error: type[ValueError] = ConfigError) -> None:
    """Stop `what` (a script's choice: "impl=deepspeed", "part=ratio") in one line, an `error`,
    when an extra it needs is absent."""
    absent = missing(extras)
    if absent:
        raise error(
            f"{what} needs {' and '.join(absent)}, which is not installed: {install_hint(absent)}"
        )


def skip_reason(absent: Iterable[str]) -> str:
    """Why a test or a launch line skips: under `make test` (DTL_REQUIRE_EXTRAS=1) the tests'
    conftest.py turns a skip that says MISSING_EXTRA into a failure."""
    absent = list(absent)
    return f"{MISSING_EXTRA}: {', '.join(absent)} ({install_hint(absent)})"
