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
#     PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# Override either choice with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.9.1".
# With --sglang on a GPU machine SGLang is installed first and the trainer takes its torch
# (SGLang 0.5.23 pins torch==2.14.1; the same wheel pins the same NCCL): the distributed weight
# sync puts both in one NCCL group, and NCCL refuses a peer of another version. The setup
# ends by comparing both venvs' torch.cuda.nccl.version().
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "[setup] moe-rl needs Python 3.10 or later (tested: 3.11); $PYTHON is $("$PYTHON" -V 2>&1): set PYTHON=python3.11" >&2
  exit 2
fi
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
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
torch_version='import importlib.metadata as m; print(m.version("torch"))'
nccl_version='import torch; print(".".join(str(p) for p in torch.cuda.nccl.version() if p != ""))'

pinned=${TORCH_SPEC:+1}  # a torch that must be the one installed (given, or SGLang's)
if [[ $sglang == 1 && $gpu == 1 ]]; then
  # SGLang lives in a venv of its own (its many pins stay out of the trainer's); moe-rl starts
  # it with rollout.server.python=.venv-sglang/bin/python
  [[ -x .venv-sglang/bin/python ]] || "$PYTHON" -m venv .venv-sglang
  echo "[setup] installing sglang==0.5.23 into .venv-sglang (GPU)"
  .venv-sglang/bin/python -m pip --disable-pip-version-check -q install "sglang==0.5.23"
  if [[ -z "${TORCH_SPEC:-}" ]]; then
    TORCH_SPEC="torch==$(.venv-sglang/bin/python -c "$torch_version")" pinned=1
    echo "[setup] the trainer takes SGLang's torch ($TORCH_SPEC): one NCCL on both sides of the weight sync"
  fi
fi
if [[ -z "${TORCH_SPEC:-}" ]]; then
  if [[ $gpu == 1 ]]; then TORCH_SPEC="torch>=2.6"; else TORCH_SPEC="torch==2.13.0"; fi
fi
installed=$("$VENV/bin/python" -c "$torch_version" 2>/dev/null || true)
want=${TORCH_SPEC#torch==}
[[ $want == *+* ]] || installed=${installed%%+*}  # 2.13.0+cpu is 2.13.0 unless a local build is asked for
if [[ -z "$installed" || ( -n "$pinned" && "$TORCH_SPEC" == torch==* && "$installed" != "$want" ) ]]; then
  echo "[setup] installing $TORCH_SPEC${installed:+ (replacing torch $installed)}"
  "${PIP[@]}" install "$TORCH_SPEC" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

echo "[setup] installing moe-rl$extras (editable) and its dependencies"
# (the grep hides pip's noise about this machine's empty local index folders)
"${PIP[@]}" install -e ".$extras" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$VENV/bin/python" -c "import moe_rl, parallel, torch; print(f'[setup] ok: moe_rl {moe_rl.__version__}, torch {torch.__version__}')"

if [[ $sglang == 1 && $gpu == 1 ]]; then
  trainer=$("$VENV/bin/python" -c "$nccl_version")
  server=$(.venv-sglang/bin/python -c "$nccl_version")
  if [[ "$trainer" != "$server" ]]; then
    echo "[setup] error: the trainer's NCCL $trainer differs from .venv-sglang's NCCL $server: the distributed" \
      "weight sync needs one NCCL (rerun without TORCH_SPEC to take SGLang's torch, give both venvs one nvidia-nccl wheel, or use rollout.weight_sync.method=disk)" >&2
    exit 1
  fi
  echo "[setup] ok: NCCL $trainer in both venvs"
elif [[ $sglang == 1 ]]; then
  # a CPU machine: the CPU install with its shims in .venv-sglang (tools/sglang_cpu/install.sh)
  bash tools/sglang_cpu/install.sh
fi
