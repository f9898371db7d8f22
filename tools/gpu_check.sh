#!/usr/bin/env bash
# One command on a single-GPU machine that has torch (and maybe transformers) but no
# network: install what is missing from ./wheels, then run tools/gpu_check.py, which
# writes gpu_check.json (about 5-8 minutes on one H200; see its docstring for the stages).
#
#   bash tools/gpu_check.sh [--only env,matmul,parity,train,colocated,big_moe,logprob_memory,kernels,fusions]
#
# ./wheels (git-ignored) is filled on a machine with network by `bash tools/gpu_wheels.sh`
# (for the GPU machine's Python, 3.12 on the lent H200s): every wheel moe-rl needs except
# torch's own family (torch, triton, nvidia-*), which the GPU machine already has. Each
# wheel is installed with --no-deps when its package is missing or at another version (a
# preinstalled older transformers is upgraded); a missing dependency shows as a failed
# import in gpu_check.json's "env" stage instead of a download attempt.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ -d wheels ]] && compgen -G "wheels/*.whl" >/dev/null; then
  for wheel in wheels/*.whl; do
    file=$(basename "$wheel")
    name=$(echo "$file" | cut -d- -f1 | tr '_' '-')
    version=$(echo "$file" | cut -d- -f2)
    installed=$("$PYTHON" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    if [[ "$installed" != "$version" ]]; then
      "$PYTHON" -m pip install -q --no-index --no-deps "$wheel" || echo "[gpu_check] could not install $wheel"
    fi
  done
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" tools/gpu_check.py --out gpu_check.json "$@"
