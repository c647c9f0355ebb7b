#!/usr/bin/env bash
# Create or reuse the project environment at .venv/ (Python 3.12) with the pinned stack.
#
# Idempotent: a second run with unchanged pins only checks the imports (seconds). The slow part
# of a first run is Transformer Engine's torch extension, which is built from source (~16 of the
# ~20 minutes a first setup takes on 2 cores); pip keeps the built wheel in its cache, so later
# fresh venvs on the same machine install it in seconds.
#
#   bash scripts/setup.sh            # then: .venv/bin/python -c "import torch, mbridge_refit"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
reqs="$root/scripts/requirements.txt"
BRIDGE_PIN="megatron-bridge==0.6.2"
TE_PIN="transformer-engine[pytorch,core_cu13]==2.20.2"
MAMBA_PIN="mamba-ssm==2.3.2.post1"
# CUDA 13.0 headers TE's torch extension needs beyond torch's wheels (crt/, nv/target), where no toolkit is installed
CUDA_HEADER_PINS="nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85"
log() { echo "[setup] $*" >&2; }

find_python312() {
  if python3.12 -c pass 2>/dev/null; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}" ]; then
    local v
    for v in $(ls "${PYENV_ROOT:-$HOME/.pyenv}/versions" 2>/dev/null | grep '^3\.12\.' | sort -V -r); do
      PYENV_VERSION="$v" python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null && return
    done
  fi
  log "Python 3.12 not found: install it (e.g. 'pyenv install 3.12') or put python3.12 on PATH."
  exit 1
}

stamp_value="$(cat "$reqs" "$0" "$root/pyproject.toml" | sha256sum | cut -c1-16)"
stamp="$venv/.setup-stamp"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$stamp_value" ] \
   && "$venv/bin/python" -c "import torch, transformer_engine.pytorch, megatron.bridge, mamba_ssm, mbridge_refit" 2>/dev/null; then
  log "environment up to date: $venv"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python312)"
  log "creating $venv with $py"
  "$py" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip "$@"; }
pip install -q --upgrade pip wheel "setuptools<82"  # torch 2.11 requires setuptools<82
log "installing pinned requirements (torch is ~4.6 GB on first install)"
pip install -q -r "$reqs"
log "installing $BRIDGE_PIN without its dependency list"
pip install -q --no-deps "$BRIDGE_PIN"

# Transformer Engine: `import megatron.bridge` imports transformer_engine.pytorch, which loads TE's torch
# extension; its sdist builds it from C++ sources only (a CppExtension: no .cu file, nvcc never compiles
# anything), against CUDA's headers. With a CUDA toolkit (nvcc under CUDA_HOME) its headers are used; without
# one (a CPU machine) the headers come from NVIDIA's pip wheels: torch's CUDA runtime wheels plus the two
# header wheels below, of the same CUDA release (TE's build reads every nvidia/*/include when it finds no toolkit).
if ! "$venv/bin/python" -c "import torch, transformer_engine.pytorch" 2>/dev/null; then
  site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" NVTE_FRAMEWORK=pytorch MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  export CPATH="$CUDA_HOME/include:$site/nvidia/nccl/include:$site/nvidia/cudnn/include:$site/nvidia/cu13/include${CPATH:+:$CPATH}"
  if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
    log "no CUDA toolkit under CUDA_HOME=$CUDA_HOME: building against the CUDA headers of pip wheels ($CUDA_HEADER_PINS)"
    # shellcheck disable=SC2086  # the pins are words
    pip install -q --no-deps $CUDA_HEADER_PINS
    unset CUDA_HOME  # TE's build then finds no toolkit and takes the wheels' headers
  fi
  log "installing $TE_PIN (builds the torch extension from source unless pip's cache has it)"
  pip install -q --no-build-isolation "$TE_PIN"
fi

# Mamba layers (Nemotron-H): Megatron-Core builds them from mamba-ssm's Triton ops only. Its sdist
# would download or compile CUDA extensions: built without them here (seconds). The package still
# imports one at the top (selective_scan_cuda): where none is installed, the project's stand-in,
# which raises if anything calls into it, is put beside it (models build; no Mamba forward runs).
if ! "$venv/bin/python" -c "import mamba_ssm" 2>/dev/null; then
  site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  log "installing $MAMBA_PIN without its CUDA extensions"
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install -q --no-deps --no-build-isolation "$MAMBA_PIN"
  "$venv/bin/python" -c "import selective_scan_cuda" 2>/dev/null \
    || cp -r "$root/scripts/gpu/stubs/selective_scan_cuda" "$site/"
fi

log "installing mbridge_refit (editable)"
pip install -q --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -c "import torch, transformer_engine.pytorch, megatron.bridge, mamba_ssm, mbridge_refit; print('[setup] ready: torch', torch.__version__)"
echo "$stamp_value" > "$stamp"
