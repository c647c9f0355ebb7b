#!/usr/bin/env bash
# Prepare an offline wheelhouse of vLLM 0.26.0 (requires torch==2.11.0, transformers>=5.5.3) for
# the GPU host, in parts under the 64 MiB upload limit.
#
# Run from the project root:  bash scripts/gpu/prepare-vllm-wheelhouse.sh
# It fills .gpu/ (git-ignored):
#   .gpu/v1 .. vN/  the vLLM wheel split in parts, then the other wheels of vllm-requirements.txt,
#                   packed into folders of at most 56 MiB
#   .gpu/v0/        install-vllm.sh and the wheel's checksum (small)
# Upload v1..vN one by one (each: mkdir -p /tmp/vllm-wheelhouse && cp .gpu/vK/* /tmp/vllm-wheelhouse/),
# then carry .gpu/v0 and run: bash .gpu/v0/install-vllm.sh   (after .gpu/p0/install.sh if you need TE too)
# Seen working on an H200 host, 2026-11-23: import, LLM(load_format="dummy") on a tiny Qwen3,
# generate, collective_rpc, vllm.config.WeightTransferConfig. Engine start took ~100 s the first time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(git rev-parse --show-toplevel)"
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
PY=${PYTHON312:-python3.12}
"$PY" -c pass 2>/dev/null || export PYENV_VERSION=3.12.1
plats=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do plats+=(--platform "${p}_x86_64"); done
mkdir -p .gpu/vbig .gpu/v0
if [ ! -f .gpu/vbig/done ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
      -d .gpu/vbig vllm==0.26.0 2>&1 | grep -v WARNING || true
  rm -rf .gpu/v[1-9]*
  ( cd .gpu/vbig && split -b 56M -d -a 1 vllm-0.26.0-*.whl vllm.part )
  i=1; for part in .gpu/vbig/vllm.part*; do mkdir -p .gpu/v$i; mv "$part" .gpu/v$i/; i=$((i+1)); done
  echo $((i-1)) > .gpu/vbig/parts
  ( cd .gpu/vbig && md5sum vllm-0.26.0-*.whl > ../v0/vllm.md5 && rm -f vllm-0.26.0-*.whl && touch done )
fi
grep -v -E '^(#|vllm==)' "$here/vllm-requirements.txt" > .gpu/vbig/deps.txt
mkdir -p .gpu/vbig/deps
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
    -d .gpu/vbig/deps -r .gpu/vbig/deps.txt 2>&1 | grep -v WARNING || true
# pack the dependency wheels into folders after the wheel's parts, at most 56 MiB each
n=$(cat .gpu/vbig/parts)
for d in .gpu/v[1-9]*; do [ "${d#.gpu/v}" -gt "$n" ] && rm -rf "$d"; done
n=$((n+1)); mkdir -p .gpu/v$n; used=0
for w in $(ls -S .gpu/vbig/deps/*.whl); do
  size=$(stat -c %s "$w")
  if [ $((used + size)) -gt $((56 * 1024 * 1024)) ]; then n=$((n+1)); mkdir -p .gpu/v$n; used=0; fi
  cp "$w" .gpu/v$n/; used=$((used + size))
done
cp "$here/install-vllm.sh" .gpu/v0/install-vllm.sh
du -sh .gpu/v[0-9] | sed 's/^/  /'
echo "vLLM wheelhouse ready in .gpu/ (upload v1..v$(ls -d .gpu/v[1-9]* | wc -l), then carry v0 and run: bash .gpu/v0/install-vllm.sh)"
