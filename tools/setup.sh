#!/usr/bin/env bash
# Create ./.venv and install moe-rl into it (idempotent: a second run is quick).
#
#   bash tools/setup.sh          # runtime install
#   bash tools/setup.sh --dev    # plus the test tools
#   bash tools/setup.sh --sglang # plus real SGLang in ./.venv-sglang (flags combine)
#
# torch comes first, so that the package's own "torch>=2.6" pulls nothing more:
#   - a machine with an NVIDIA driver (nvidia-smi on PATH) gets the normal wheel from PyPI;
#   - a CPU machine gets torch==2.13.0 (on the project's dev/CI machines a CPU build
#     that lies on local disk; elsewhere point pip at a CPU index, e.g.
#     PIP_INDEX_URL=https://download.pytorch.org/whl/cpu).
# Override either choice with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.9.1".
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
extras=""
sglang=0
for flag in "$@"; do
  case "$flag" in
    --dev) extras="[dev]" ;;
    --sglang) sglang=1 ;;
    *) echo "usage: bash tools/setup.sh [--dev] [--sglang]" >&2; exit 2 ;;
  esac
done

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [[ -z "${TORCH_SPEC:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC="torch>=2.6"; else TORCH_SPEC="torch==2.13.0"; fi
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

echo "[setup] installing moe-rl$extras (editable) and its dependencies"
# (the grep hides pip's noise about this machine's empty local index folders)
"${PIP[@]}" install -e ".$extras" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$VENV/bin/python" -c "import moe_rl, parallel, torch; print(f'[setup] ok: moe_rl {moe_rl.__version__}, torch {torch.__version__}')"

if [[ $sglang == 1 ]]; then
  # SGLang lives in a venv of its own (its pins differ from the trainer's); moe-rl starts it
  # with rollout.server_python=.venv-sglang/bin/python. A GPU machine takes SGLang as
  # published; a CPU machine the CPU install with its shims (tools/sglang_cpu/install.sh).
  if command -v nvidia-smi >/dev/null 2>&1; then
    [[ -x .venv-sglang/bin/python ]] || "$PYTHON" -m venv .venv-sglang
    echo "[setup] installing sglang==0.5.23 into .venv-sglang (GPU)"
    .venv-sglang/bin/python -m pip --disable-pip-version-check -q install "sglang==0.5.23"
  else
    bash tools/sglang_cpu/install.sh
  fi
fi
