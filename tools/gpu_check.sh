#!/usr/bin/env bash
# One command on a single-GPU machine that has torch (and maybe transformers) but no
# network: install what is missing from ./wheels, then run tools/gpu_check.py, which
# writes gpu_check.json (about 5-8 minutes on one H200; see its docstring for the stages).
#
#   bash tools/gpu_check.sh [--only env,matmul,parity,train,big_moe,logprob_memory]
#
# ./wheels (git-ignored) is filled on a machine with network, for the GPU machine's Python
# (3.12 on the lent H200s) and without torch, which is already there:
#
#   pip download --dest wheels --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#     "megatron-core==0.16.1" "transformers>=4.56" safetensors tensorboard "math-verify>=0.8" \
#     httpx pyyaml tqdm matplotlib
#
# (drop what the GPU machine already has; datasets/pyarrow are needed only for dataset
# files, deepspeed only for the launcher: neither is used here). Each wheel is installed
# with --no-deps, so a missing dependency shows as a failed import in gpu_check.json's
# "env" stage instead of a download attempt.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ -d wheels ]] && compgen -G "wheels/*.whl" >/dev/null; then
  for wheel in wheels/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr '_' '-')
    if ! "$PYTHON" -m pip show -q "$name" >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-index --no-deps "$wheel" || echo "[gpu_check] could not install $wheel"
    fi
  done
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" tools/gpu_check.py --out gpu_check.json "$@"
