#!/usr/bin/env bash
# Install real SGLang for CPU into ./.venv-sglang (beside the project's .venv), for the
# real-server tests and for CPU users. GPU machines install SGLang normally instead
# (tools/setup.sh --sglang does that when nvidia-smi is on PATH).
#
#   bash tools/sglang_cpu/install.sh        # or: bash tools/setup.sh --sglang
#
# What it does, in order (idempotent: a second run with nothing changed is a stamp check):
#   1. a venv with the CPU torch build (torch==2.13.0; torchvision 0.28.0, its pair);
#   2. sglang==0.5.23 with --no-deps (its metadata pins CUDA wheels: torch 2.14.1,
#      sglang-kernel, flashinfer, ...) and its runtime dependencies pinned in
#      requirements.txt beside this script;
#   3. three CPU shims, each checked: the install fails loudly if the line it changes is
#      not where it expected (a new SGLang or torchvision: re-measure, then update here):
#      a. sgl_kernel: SGLang imports it unconditionally in a few modules (host memory
#         pool, allocator). PyPI's sgl-kernel/sglang-kernel are CUDA builds that fail to
#         import here. An import-only placeholder (tools/sglang_cpu/sgl_kernel: every name
#         resolves, calling one raises) satisfies the imports; torch.ops.sgl_kernel stays
#         empty, so SGLang detects no AMX kernels and takes its plain-torch paths.
#      b. torchvision: PyPI's wheel is a CUDA build whose compiled ops do not load beside
#         CPU torch, and SGLang (via transformers' image utils and its multimodal configs)
#         imports torchvision. Its _meta_registrations.py registers fakes for
#         torchvision::nms/qnms unconditionally (the other ops are already guarded by
#         torchvision.extension._has_ops()): guard those two the same way.
#      c. sglang/srt/state_capturer/base.py: with --enable-return-routed-experts the host
#         buffer is allocated with pin_memory=True, which CPU torch refuses: pin only when
#         CUDA is available.
# Launching it on CPU: see docs/sglang.md (moe-rl chooses the CPU flags
# itself when it launches the server).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=tools/sglang_cpu
PYTHON=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_SPEC=${SGLANG_TORCH_SPEC:-torch==2.13.0}
TORCHVISION_SPEC=${SGLANG_TORCHVISION_SPEC:-torchvision==0.28.0}

stamp="$VENV/.moe-rl-sglang-cpu"
want=$(cat "$0" "$HERE/requirements.txt" "$HERE"/sgl_kernel/*.py | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "[sglang] $VENV is up to date (sglang $SGLANG_VERSION, CPU)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[sglang] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" -e "^ERROR: pip's dependency resolver" -e "^sglang $SGLANG_VERSION requires" >&2); }
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_SPEC" > "$constraints"  # nothing may replace the CPU torch

echo "[sglang] installing $TORCH_SPEC (CPU) and $TORCHVISION_SPEC"
quiet "${PIP[@]}" install "$TORCH_SPEC"
quiet "${PIP[@]}" install -c "$constraints" "$TORCHVISION_SPEC"
echo "[sglang] installing sglang==$SGLANG_VERSION (--no-deps) and its CPU runtime dependencies"
quiet "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
quiet "${PIP[@]}" install -c "$constraints" -r "$HERE/requirements.txt"

site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# patch FILE ORIGINAL PATCHED COUNT: replace the COUNT lines equal to ORIGINAL (whole
# line, fixed string) by PATCHED; already patched is fine; anything else fails.
patch_lines() {
  local file=$1 original=$2 patched=$3 count=$4
  [[ -f "$file" ]] || { echo "[sglang] shim: $file not found" >&2; exit 1; }
  local have_patched have_original
  have_patched=$(grep -cxF -- "$patched" "$file" || true)
  have_original=$(grep -cxF -- "$original" "$file" || true)
  if [[ "$have_patched" == "$count" && "$have_original" == 0 ]]; then return 0; fi
  if [[ "$have_original" != "$count" || "$have_patched" != 0 ]]; then
    echo "[sglang] shim: expected $count line(s) '$original' in $file, found $have_original (patched: $have_patched)" >&2
    exit 1
  fi
  "$VENV/bin/python" - "$file" "$original" "$patched" <<'PY'
import sys
path, original, patched = sys.argv[1:]
lines = open(path).read().split("\n")
open(path, "w").write("\n".join(patched if line == original else line for line in lines))
PY
}

echo "[sglang] applying the CPU shims"
# a. the sgl_kernel placeholder (refuse to shadow a real one)
if [[ -d "$site/sgl_kernel" ]] && ! grep -qx "PLACEHOLDER = True" "$site/sgl_kernel/__init__.py" 2>/dev/null; then
  echo "[sglang] shim: a real sgl_kernel is installed in $site; remove it (CUDA build) first" >&2
  exit 1
fi
rm -rf "$site/sgl_kernel"
cp -r "$HERE/sgl_kernel" "$site/sgl_kernel"
# b. torchvision's two unguarded fake registrations
for op in nms qnms; do
  patch_lines "$site/torchvision/_meta_registrations.py" \
    "@torch.library.register_fake(\"torchvision::$op\")" \
    "@(torch.library.register_fake(\"torchvision::$op\") if torchvision.extension._has_ops() else (lambda fn: fn))" 1
done
# c. the routed-experts host buffer is pinned only with CUDA
patch_lines "$site/sglang/srt/state_capturer/base.py" \
  "            pin_memory=True," \
  "            pin_memory=torch.cuda.is_available()," 1

echo "[sglang] checking the install"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore - "$SGLANG_VERSION" <<'PY'
import importlib.metadata, sys
import torch
import sglang.launch_server  # noqa: F401 - the server's whole import chain
import sglang.srt.managers.scheduler  # noqa: F401
import sglang.srt.model_executor.model_runner  # noqa: F401
import sgl_kernel

version = importlib.metadata.version("sglang")
assert version == sys.argv[1], f"sglang {version}, expected {sys.argv[1]}"
assert getattr(sgl_kernel, "PLACEHOLDER", False), "sgl_kernel is not the CPU placeholder"
print(f"[sglang] ok: sglang {version}, torch {torch.__version__} in {sys.prefix}")
PY
echo "$want" > "$stamp"
