#!/usr/bin/env bash
# One short GPU slot, prepared: install from a wheel folder with no network, run the time-boxed
# GPU check, and pack everything it wrote into one archive to carry back.
#
#   tools/gpu_slot.sh [WHEELS] [BUDGET_S] [OUT]       e.g. tools/gpu_slot.sh wheelhouse 420 /tmp/out
#
# PY (default python3): the box's interpreter, whose CUDA torch is kept. WHEELS: what
# tools/wheelhouse.py built for the box (make wheelhouse WHEEL_PYTHON=... HAVE=...). BUDGET_S:
# seconds for the check itself (the install, ~1 min, comes on top). OUT: where the archive and a
# copy of the summary go. The check's plan and estimates: `python -m dtl.tour --gpu-check
# --dry-run`.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-wheelhouse}"
BUDGET_S="${2:-420}"
OUT="${3:-outputs}"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
make install PY="$PY" WHEELS="$WHEELS" 2>&1 | tail -5
echo "gpu_slot: installed in $(( $(date +%s) - start )) s"
"$PY" -m dtl.tour --gpu-check --budget_s="$BUDGET_S" --out outputs/gpu_check
code=$?
tar czf "$OUT/gpu_check.tgz" outputs/gpu_check
cp outputs/gpu_check/summary.md "$OUT/summary.md" 2>/dev/null || true
echo "gpu_slot: exit $code after $(( $(date +%s) - start )) s; $OUT/gpu_check.tgz"
exit $code
