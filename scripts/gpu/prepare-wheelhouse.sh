#!/usr/bin/env bash
# Prepare an offline wheelhouse for a GPU host that has CUDA 13, Python 3.12 and
# torch 2.11 but no package index, and that accepts at most 64 MiB per upload.
#
# Run from the project root:  bash scripts/gpu/prepare-wheelhouse.sh [EXTRA_REQUIREMENT ...]
# It fills .gpu/ (git-ignored through .git/info/exclude):
#   .gpu/p0/        small wheels + install.sh            (~20 MiB)
#   .gpu/p1 .. p5/  Transformer Engine core wheel, split  (~56 MiB each)
# Upload p1..p5 one by one (each under 64 MiB), then p0, then on the host:
#   bash .gpu/p0/install.sh            # joins the parts, installs, builds TE's torch extension
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(git rev-parse --show-toplevel)"
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
PY=${PYTHON312:-python3.12}
"$PY" -c pass 2>/dev/null || export PYENV_VERSION=3.12.1
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@" 2>&1 | grep -v WARNING || true; }
sdist() { "$PY" -m pip download -q --no-deps -d "$@" 2>&1 | grep -v WARNING || true; }
mkdir -p .gpu/p0 .gpu/big
if [ ! -f .gpu/big/done ]; then
  dl .gpu/big transformer-engine-cu13==2.20.2
  rm -f .gpu/p[1-9]/te_core.part*
  ( cd .gpu/big && split -b 56M -d -a 1 transformer_engine_cu13-*.whl te_core.part )
  i=1; for part in .gpu/big/te_core.part*; do mkdir -p .gpu/p$i; mv "$part" .gpu/p$i/; i=$((i+1)); done
  ( cd .gpu/big && md5sum transformer_engine_cu13-*.whl > ../p0/te_core.md5 && rm -f transformer_engine_cu13-*.whl && touch done )
fi
dl .gpu/p0 transformer-engine==2.20.2 megatron-core==0.19.2 megatron-bridge==0.6.2 transformers==5.12.1 \
   tokenizers==0.22.2 omegaconf==2.3.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
   flash-linear-attention==0.6.0 fla-core==0.6.0 "$@"
sdist .gpu/p0 transformer-engine-torch==2.20.2 antlr4-python3-runtime==4.9.3
# mamba-ssm (Nemotron-H's Mamba layers): Megatron builds them from its Triton ops only; the sdist's own
# build would download a prebuilt CUDA wheel, so it is built here without its CUDA extension
# (its package still imports one: scripts/gpu/stubs/selective_scan_cuda stands in for it). The build
# imports torch and setuptools: it runs in the project's environment (bash scripts/setup.sh makes it).
if ! ls .gpu/p0/mamba_ssm-*.whl >/dev/null 2>&1; then
  [ -x .venv/bin/python ] || bash scripts/setup.sh
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/p0 mamba-ssm==2.3.2.post1
fi
cp "$here/install.sh" .gpu/p0/install.sh
du -sh .gpu/p* | sed 's/^/  /'
echo "wheelhouse ready in .gpu/ (upload p1..p$(ls -d .gpu/p[1-9] | wc -l), then p0; then run: bash .gpu/p0/install.sh)"
