#!/usr/bin/env bash
# On a machine with network: fill ./wheels for tools/gpu_check.sh on a GPU machine that
# has torch (and its CUDA libraries) but no network. Resolves what moe-rl needs for the
# GPU machine's Python, then downloads every wheel except torch's own family (torch,
# triton, nvidia-*, and torch's pure-Python deps sympy/mpmath/networkx), each --no-deps,
# so no multi-GB CUDA wheel is fetched.
#
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12 (the lent H200s)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PIP=${PIP:-python3 -m pip}
PLATFORMS=(--only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any)
PACKAGES=("megatron-core==0.16.1" "transformers>=4.56" safetensors tensorboard "math-verify>=0.8" httpx pyyaml tqdm matplotlib)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PIP install --dry-run --ignore-installed --quiet --report "$work/report.json" --target "$work/target" "${PLATFORMS[@]}" "${PACKAGES[@]}"
python3 - "$work/report.json" >"$work/wheels.txt" <<'PY'
import json, sys
skip = ("torch", "triton", "nvidia-", "sympy", "mpmath", "networkx")
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not name.lower().replace("_", "-").startswith(skip):
        print(f"{name}=={version}")
PY
mkdir -p wheels
$PIP download --no-deps --dest wheels "${PLATFORMS[@]}" -r "$work/wheels.txt"
echo "[gpu_wheels] $(wc -l <"$work/wheels.txt") wheels in ./wheels (torch's family left to the GPU machine)"
