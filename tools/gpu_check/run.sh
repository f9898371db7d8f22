#!/usr/bin/env bash
# One command on a GPU machine with no network (the lent H200): install what it lacks from
# wheels/ (carried with the tree), then run tools/gpu_check/check.py's stages; gpu_check.json and
# gpu_check.log go to $OUT when it is set (the folder the device tool brings back), else to
# runs/gpu_check/. Within 8 minutes on one H200 (--quick: 4; --scale, the real-shape stages: 8;
# --all, both sets in one command: 9, what does not fit SKIPPED for a second command with --only).
#
#   bash tools/gpu_check/run.sh [--quick | --smoke] [--scale | --all] [--budget S] [--only STAGE,...] [--in-process]
#   bash tools/gpu_check/run.sh --dry-run [--packages LIST]   # what it would install; nothing runs
#
# --smoke: tiny sizes, any machine (CPU: the CUDA-only checks say SKIPPED). --dry-run plans
# against LIST (e.g. tools/gpu_check/h200_packages.txt), else against this python's packages.
# wheels/ and tools/gpu_check/wheels.json come from `bash tools/gpu_check/wheels.sh`; only the locked
# packages this python lacks are installed (pip --no-deps, into a folder of their own put on
# PYTHONPATH): nothing preinstalled is replaced.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
mode=full dry=0 packages=() pass=()
while (($#)); do
  case "$1" in
    --quick) mode=quick ;;
    --smoke) mode=smoke ;;
    --dry-run) dry=1 ;;
    --packages) packages=(--packages "$2"); shift ;;
    *) pass+=("$1") ;;
  esac
  shift
done
if ((dry)); then
  exec "$PYTHON" -m tools.gpu_check.install plan "${packages[@]}" --wheels wheels
fi
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
log="$out/gpu_check.log"
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
{
  echo "[gpu_check] $(date '+%F %T') mode=$mode python=$PYTHON out=$out"
  timeout 30 "$PYTHON" -m tools.gpu_check.install install --wheels wheels --target "$site" --report "$out/install.json"
  echo "[gpu_check] install step exit $?"
} 2>&1 | tee "$log"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -m tools.gpu_check.check --mode "$mode" --out-dir "$out" --install-report "$out/install.json" "${pass[@]}" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
