#!/usr/bin/env bash
# Where the package registry answers: fill ./wheels (git-ignored) with what tools/gpu_check/run.sh
# installs on the lent GPU machine (no network there), and pin it in tools/gpu_check/wheels.json.
#
#   bash tools/gpu_check/wheels.sh [MACHINE_PACKAGE_LIST]    # default: tools/gpu_check/h200_packages.txt
#   bash tools/gpu_check/wheels.sh --peer    # wheels/peer: TRL and what it needs that the H200 lacks
#                                      # (gpu_check --scale's peer stage installs them there)
#
# Only what that machine lacks: moe-rl's dependencies (pyproject.toml) not on the list, less those
# the check never imports (deepspeed, datasets: tools/gpu_check/install.py LEFT_OUT), and what they
# need that the list lacks; wheels for Python 3.12 on linux x86_64, each pinned to this python's
# version where it fits (what the tests ran), fetched --no-deps. Prints the wheels' size and what
# travels with the working tree; exits 1 over 40 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
if [[ ${1:-} == --peer ]]; then
  # the versions tools/bench/peer.py's TRL side ran with; datasets' own pins (dill, multiprocess)
  exec "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any -d wheels/peer "trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
fi
exec "$PYTHON" -m tools.gpu_check.install lock --packages "${1:-tools/gpu_check/h200_packages.txt}" --wheels wheels
