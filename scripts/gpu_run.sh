#!/usr/bin/env bash
# On the GPU host (after .gpu/p0/install.sh), from the repo root: the GPU runs of the FP8,
# refit-sink and verifier issues, each bounded by a timeout; logs and JSON go to $OUT (default
# /tmp/out). With two GPUs it also runs the TP=2 verifier and the packed-broadcast benchmark.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 12 "$OUT/$name.log" | grep -v -i warn; }
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton; print('triton', triton.__version__)"
step bench_fp8_tp1 240 torchrun --nproc-per-node 1 scripts/bench_export.py --model qwen3-8b --tp 1 --steady 5 --fp8 --out-dir "$OUT"
step verify_1.7b_tp1 150 python3 -m mbridge_refit.verify_refit --shape qwen3-1.7b --json "$OUT/verify_qwen3-1.7b_tp1.json"
step verify_1.7b_tp1_perturbed 150 python3 -m mbridge_refit.verify_refit --shape qwen3-1.7b --perturb model.layers.10.mlp.down_proj.weight --json "$OUT/verify_qwen3-1.7b_tp1_perturbed.json"
step verify_tiny_tp1 90 python3 -m mbridge_refit.verify_refit --recipe qwen3-tiny --json "$OUT/verify_qwen3-tiny_tp1.json"
step fp8_checkpoint 180 python3 scripts/check_fp8_checkpoint.py --work /tmp/fp8check --out-dir "$OUT"
if [ "$gpus" -ge 2 ]; then
  step bench_refit_broadcast 300 torchrun --nproc-per-node 2 scripts/bench_refit_broadcast.py --model qwen3-8b --out-dir "$OUT"
  step verify_1.7b_tp2 150 torchrun --nproc-per-node 2 -m mbridge_refit.verify_refit --shape qwen3-1.7b --tp 2 --json "$OUT/verify_qwen3-1.7b_tp2.json"
  step verify_tiny_tp2 120 torchrun --nproc-per-node 2 -m mbridge_refit.verify_refit --recipe qwen3-tiny --tp 2 --json "$OUT/verify_qwen3-tiny_tp2.json"
fi
