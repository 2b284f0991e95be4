"""Test-wide settings: one thread per rank, Hugging Face offline, DeepSpeed's prebuilt ops, and
NCCL's rules on gloo in every process the tests start (dtl/compat.py, dtl/nccl_rules.py)."""

import os

# the course's code may not call torch 2.13-only collectives: they fail as on torch 2.11/2.12
os.environ.setdefault("DTL_HIDE_NEW_COLLECTIVES", "1")
# sends and receives match in posting order, as on NCCL, not by tag as gloo would
os.environ.setdefault("DTL_P2P_IGNORE_TAGS", "1")

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DTL_TIMEOUT_S", "60")
# a plain `pytest` finds DeepSpeed's prebuilt ops, with the ninja that built them, as make does
from dtl.registry import use_venv_tools  # noqa: E402

use_venv_tools(os.environ)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than let DeepSpeed warn
torch.set_num_threads(1)  # two cores, two ranks: one thread each, this process included


# --- make test: a missing Python extra fails, it does not skip (dtl.extras) -------------------
import pytest  # noqa: E402

from dtl.extras import MISSING_EXTRA  # noqa: E402


def _strict(report) -> None:
    if os.environ.get("DTL_REQUIRE_EXTRAS") != "1" or not report.skipped:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if MISSING_EXTRA in reason:
        report.outcome = "failed"
        report.longrepr = f"DTL_REQUIRE_EXTRAS=1 (make test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _strict(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _strict(outcome.get_result())
