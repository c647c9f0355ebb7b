#!/usr/bin/env bash
# The main job on the built-in tiny default, end to end, on CPU (no downloads):
#   1. write a tiny random Qwen3 HF checkpoint from the recipe in recipes/,
#   2. load it into a Megatron model split TP=2 x PP=2 over 4 ranks (torchrun, gloo),
#      export it back with RefitBridge into a new HF checkpoint,
#   3. verify the result against the source, tensor by tensor, bit for bit.
# Usage: bash scripts/demo.sh [OUT_DIR]   (default: out/demo)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
out="${1:-$root/out/demo}"
py="$root/.venv/bin/python"
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
cd "$root"
"$py" -m mbridge_refit.convert make-tiny --recipe qwen3-tiny --out "$out/hf" --max-shard-bytes 200000 --overwrite
"$py" -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-29517}" \
  -m mbridge_refit.convert roundtrip --hf "$out/hf" --out "$out/roundtrip" --tp 2 --pp 2 --device cpu --overwrite
"$py" -m mbridge_refit.convert verify "$out/hf" "$out/roundtrip"
