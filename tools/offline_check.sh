#!/usr/bin/env bash
# The offline install, shown: a fresh venv, no network at all, everything from the wheel folder,
# then the suite's smoke lines. Linux, as root (a network namespace of its own: unshare -n).
#
#   tools/offline_check.sh [WHEELS] [TORCH_WHEELS]
#
# WHEELS (default wheelhouse/): what tools/wheelhouse.py built. TORCH_WHEELS: a folder with a torch
# wheel for this machine (a GPU box has its torch already; a fresh venv here does not).
# Inside the namespace only the loopback interface exists, so a pip call that reaches for an
# index fails at once instead of quietly downloading.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="$(realpath "${1:-wheelhouse}")"
TORCH_WHEELS="${2:-}"
VENV="$(mktemp -d)/venv"
SMOKE="day15-collectives or day18-ds-zero3 or day20-interleaved or day22-ours or day28-fsdp2"

offline() {  # run "$@" with no network: a namespace with only loopback (gloo needs it up)
    unshare -n bash -c 'ip link set lo up && "$@"' offline "$@"
}

start=$(date +%s)
python3 -m venv "$VENV"
export PIP_CONFIG_FILE=/dev/null  # no index or find-links from this machine's pip config
if [[ -n "$TORCH_WHEELS" ]]; then
    offline "$VENV/bin/pip" install --quiet --no-index --find-links "$TORCH_WHEELS" \
        --find-links "$WHEELS" torch
fi
offline make install PY="$VENV/bin/python" WHEELS="$WHEELS"
offline "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_lessons.py -k "$SMOKE"
echo "offline_check: fresh venv, no network, $(ls "$WHEELS"/*.whl | wc -l) wheels" \
    "($(du -sm "$WHEELS" | cut -f1) MiB): installed and the smoke lines passed in" \
    "$(( $(date +%s) - start )) s"
