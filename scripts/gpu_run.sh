#!/usr/bin/env bash
# On the GPU host (after .gpu/p0/install.sh), from the repo root: the GPU runs of the export,
# FP8 and refit-sink issues, in parts that each fit one 10-minute device call. Every step is
# bounded by a timeout; logs and JSON are written to a work folder and packed into
# $OUT/<part>.tgz at the end (the device tool returns at most 8 files).
#
#   bash scripts/gpu_run.sh fp8         # FP8 issue: TE fp8_param Qwen3-MoE EP2 and Qwen3 TP2, BF16->FP8 benchmark TP1 (2 GPUs)
#   bash scripts/gpu_run.sh bench       # export benchmark TP1 (+ BF16->FP8) and TP2 (2 GPUs)
#   bash scripts/gpu_run.sh sinks       # packed broadcast benchmark, refit verifier, FP8 checkpoint in transformers
#   bash scripts/gpu_run.sh vllm-dense  # refit into vLLM == load from disk: Qwen3-1.7B BF16 and FP8 (after install-vllm.sh)
#   bash scripts/gpu_run.sh vllm-moe    # the same for Qwen3-30B-A3B cut to 4 layers (128 experts each)
#   bash scripts/gpu_run.sh vllm-deepgemm  # Qwen3-1.7B FP8 (4 layers) with vLLM's DeepGEMM as it comes (linear layers
#                                          # requantized to E8M0 on Hopper): exact; Qwen3-30B-A3B FP8 (2 layers) with DeepGEMM's
#                                          # MoE experts (VLLM_USE_DEEP_GEMM=1 set): refused by name before any weight moves
#   bash scripts/gpu_run.sh vllm-deepseek  # the same for a cut DeepSeek-V3 (recipes/shapes/deepseek-v3-cut.json: MLA with
#                                          # q_lora, 64 routed + 1 shared expert, noaux_tc sigmoid router), BF16 and FP8
#   bash scripts/gpu_run.sh contention      # bench_broadcast_contention.py (2 GPUs, torch only): the broadcasts beside the
#                                           # packed broadcast's copies and checksums, in the library's order and its variants
#   bash scripts/gpu_run.sh nccl-group      # StoreGroup over NCCL between 2 processes (GPU 0, GPU 1), no vLLM: exact transfer,
#                                           # NCCL settings mismatch refused, failures and killed members raise on both within 30 s
#   bash scripts/gpu_run.sh vllm-tp2    # sharded colocated refit into vLLM at tensor_parallel_size=2 == load from disk, trainer
#                                       # TP2 on the same 2 GPUs; against the gathering export + vLLM's load_weights (2 GPUs)
#   bash scripts/gpu_run.sh vllm-tp2-fp8  # the same into a block-FP8 engine started from the FP8 checkpoint (2 GPUs)
#   bash scripts/gpu_run.sh vllm-lora   # LoRA adapter refit into vLLM's slot == the same adapter from disk (save_hf_adapter),
#                                       # base untouched; timing against the merged full refit (Qwen3-1.7B cut to 8 layers, rank 16)
#   bash scripts/gpu_run.sh vllm-broadcast  # broadcast refit into vLLM == load from disk: Qwen3-1.7B BF16 and FP8, with faults
#   bash scripts/gpu_run.sh vllm-broadcast-moe  # the same for Qwen3-30B-A3B cut to 4 layers, BF16 and FP8
#                                           # (engine on GPU 1 over NCCL when there are 2 GPUs, else on the trainer's GPU over gloo)
#   bash scripts/gpu_run.sh vllm-bench-broadcast  # engine on GPU 1 over NCCL: ours against the raw broadcast of the
#                                                 # same bytes and vLLM's native nccl backend fed by stock (2 GPUs)
#   bash scripts/gpu_run.sh vllm-bench-broadcast-8b  # the same at Qwen3-8B only, the library's defaults
#   bash scripts/gpu_run.sh vllm-bench  # bench_refit_vllm.py, Qwen3-8B, BF16 then FP8 (vllm-bench-bf16 / vllm-bench-fp8: one of them)
#   bash scripts/gpu_run.sh vllm-bench-moe  # bench_refit_vllm.py, Qwen3-30B-A3B cut to 24 layers (9,435 tensors; 12 on an 80 GB GPU), BF16
#   bash scripts/gpu_run.sh vllm-bench-moe-fp8  # the same into a block-FP8 engine, BF16 quantized on the way
#   bash scripts/gpu_run.sh sharded     # engine-sharded refit, trainer TP2 -> engine TP2 on 2 GPUs, against the TP1 cached export and stock
#   bash scripts/gpu_run.sh families    # every registered architecture at TP1 with the TE spec against stock (check_families_gpu.py)
#   bash scripts/gpu_run.sh moe-bench   # export speed against stock, MoE shapes of 128 experts (4 layers): Qwen3-VL-30B-A3B
#                                       # from its published packed checkpoint layout, Qwen3-30B-A3B per-expert
#   bash scripts/gpu_run.sh trainer-truth  # MoE built with Megatron's expert-TP default (TP1, TP2 on 2 GPUs) against stock,
#                                          # parameters replaced under the bridge, the freshness check's cost; MoE export TP2 x ETP2
#   bash scripts/gpu_run.sh training    # export right after a Megatron DDP + distributed-optimizer step; parallel checkpoint write on the host's CPUs
set -u
part=${1:?usage: gpu_run.sh fp8|bench|sinks|contention|nccl-group|vllm-dense|vllm-deepgemm|vllm-lora|vllm-tp2|vllm-tp2-fp8|vllm-moe|vllm-deepseek|vllm-broadcast|vllm-broadcast-moe|vllm-bench-broadcast|vllm-bench-broadcast-8b|vllm-bench|vllm-bench-bf16|vllm-bench-fp8|vllm-bench-moe|vllm-bench-moe-fp8|sharded|families|moe-bench|trainer-truth|training}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RESULTS=/tmp/gpu_results_$part; rm -rf "$RESULTS"; mkdir -p "$RESULTS"
trap 'tar czf "$OUT/$part.tgz" -C "$RESULTS" .' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  echo "rc=$? $name"
  grep -v -i -E "warn|deprecat|^\s*$|number of parameters|FlexAttention" "$RESULTS/$name.log" | tail -n 25
}
two=(torchrun --nproc-per-node 2)
one=(torchrun --nproc-per-node 1)
case "$part" in
  fp8)
    step te_fp8_qwen3-30b-a3b_ep2 120 "${two[@]}" scripts/check_te_fp8_params.py --model qwen3-30b-a3b --layers 2 --experts 16 --ep 2 --stack-dump-s 110 --out-dir "$RESULTS"
    step te_fp8_qwen3-8b_tp2 170 "${two[@]}" scripts/check_te_fp8_params.py --model qwen3-8b --layers 2 --tp 2 --check-refusal --stack-dump-s 160 --out-dir "$RESULTS"
    step bench_tp1_fp8 330 "${one[@]}" scripts/bench_export.py --model qwen3-8b --tp 1 --steady 15 --fp8 --fp8-compare-bucket-mib 256,1024 --out-dir "$RESULTS"
    ;;
  bench)
    step bench_tp1_fp8 330 "${one[@]}" scripts/bench_export.py --model qwen3-8b --tp 1 --steady 15 --fp8 --fp8-compare-bucket-mib 256,1024 --out-dir "$RESULTS"
    step bench_tp2 240 "${two[@]}" scripts/bench_export.py --model qwen3-8b --tp 2 --steady 7 --compare-bucket-mib 128,1024 --out-dir "$RESULTS"
    ;;
  sharded)
    step bench_tp1 200 "${one[@]}" scripts/bench_export.py --model qwen3-8b --tp 1 --steady 15 --out-dir "$RESULTS"
    step sharded_tp2_to_tp2 240 "${two[@]}" scripts/bench_sharded_refit.py --model qwen3-8b --tp 2 --engine tp2 --tp1-json "$RESULTS/export_qwen3-8b_tp1.json" --out-dir "$RESULTS"
    ;;
  sinks)
    step bench_refit_broadcast 230 "${two[@]}" scripts/bench_refit_broadcast.py --model qwen3-8b --sweep 256x2,256x4,1024x2,2048x2 --stack-dump-s 220 --out-dir "$RESULTS"
    step verify_qwen3-1.7b_tp1 80 python3 -m mbridge_refit.convert verify-refit --shape qwen3-1.7b --json "$RESULTS/verify_qwen3-1.7b_tp1.json"
    step verify_qwen3-1.7b_tp2 80 "${two[@]}" -m mbridge_refit.convert verify-refit --shape qwen3-1.7b --tp 2 --json "$RESULTS/verify_qwen3-1.7b_tp2.json"
    # fp32 with cuBLAS TF32 off: does the fp32 difference of the last run come from TF32 GEMMs?
    step verify_qwen3-1.7b_tp2_fp32_notf32 80 env NVIDIA_TF32_OVERRIDE=0 "${two[@]}" -m mbridge_refit.convert verify-refit --shape qwen3-1.7b --tp 2 --dtype float32 --json "$RESULTS/verify_qwen3-1.7b_tp2_fp32_notf32.json"
    step verify_qwen3-tiny_tp1 60 python3 -m mbridge_refit.convert verify-refit --recipe qwen3-tiny --json "$RESULTS/verify_qwen3-tiny_tp1.json"
    step fp8_checkpoint 120 python3 scripts/check_fp8_checkpoint.py --work /tmp/fp8check --out-dir "$RESULTS"
    ;;
  nccl-group)
    step store_group_nccl 400 python3 scripts/check_store_group_nccl_gpu.py --out-dir "$RESULTS"
    ;;
  contention)
    # torch only (no install): what the packed broadcast's copies and checksums cost the broadcasts beside them
    step bench_broadcast_contention 240 torchrun --nproc-per-node 2 scripts/bench_broadcast_contention.py --gib 15.26 --bucket-mib 512 --ctas 64 --out "$RESULTS/bench_broadcast_contention.json"
    ;;
  vllm-dense|vllm-lora|vllm-moe|vllm-deepseek|vllm-tp2*|vllm-broadcast*|vllm-bench*)
    # these parts keep the CUTLASS block-FP8 kernels their earlier results were measured with; DeepGEMM at its
    # default (power-of-two requantization after loading, which the refit redoes) is the vllm-deepgemm part
    export VLLM_USE_DEEP_GEMM=0
    # prompt logprobs are compared bit for bit: without batch-invariant kernels vLLM's own logprobs differ
    # between two runs on the same weights (seen on the H100 for Qwen3-1.7B and Qwen3-30B-A3B)
    case "$part" in vllm-bench*) ;; *) export VLLM_BATCH_INVARIANT=1 ;; esac
    ;;&
  vllm-deepgemm)
    # DeepGEMM's variables left unset (vLLM's defaults) but its kernel warmup, which compiles GEMMs and touches no weight
    unset VLLM_USE_DEEP_GEMM VLLM_MOE_USE_DEEP_GEMM VLLM_USE_DEEP_GEMM_E8M0
    export VLLM_BATCH_INVARIANT=1 VLLM_DEEP_GEMM_WARMUP=skip
    step vllm_refit_qwen3-1.7b_fp8_deepgemm 300 python3 scripts/check_vllm_refit_gpu.py --model qwen3-1.7b --layers 4 --fp8 --out-dir "$RESULTS"
    step vllm_refit_qwen3-30b-a3b_fp8_deepgemm_moe 240 env VLLM_USE_DEEP_GEMM=1 python3 scripts/check_vllm_refit_gpu.py --model qwen3-30b-a3b --layers 2 --fp8 --expect-refusal --out-dir "$RESULTS"
    ;;
  vllm-dense)
    step vllm_refit_qwen3-1.7b 280 python3 scripts/check_vllm_refit_gpu.py --model qwen3-1.7b --out-dir "$RESULTS"
    step vllm_refit_qwen3-1.7b_fp8 280 python3 scripts/check_vllm_refit_gpu.py --model qwen3-1.7b --fp8 --out-dir "$RESULTS"
    ;;
  vllm-lora)
    step vllm_lora_refit_qwen3-1.7b 360 python3 scripts/check_vllm_lora_refit_gpu.py --model qwen3-1.7b --layers 8 \
      --lora-rank 16 --out-dir "$RESULTS"
    ;;
  vllm-tp2)
    step vllm_refit_tp2_qwen3-1.7b 250 "${two[@]}" scripts/check_vllm_refit_tp2_gpu.py --model qwen3-1.7b --out-dir "$RESULTS"
    step vllm_refit_tp2_qwen3-30b-a3b 230 "${two[@]}" scripts/check_vllm_refit_tp2_gpu.py --model qwen3-30b-a3b --layers 4 --out-dir "$RESULTS"
    ;;
  vllm-tp2-fp8)
    step vllm_refit_tp2_qwen3-1.7b_fp8 270 "${two[@]}" scripts/check_vllm_refit_tp2_gpu.py --model qwen3-1.7b --fp8 --out-dir "$RESULTS"
    step vllm_refit_tp2_qwen3-30b-a3b_fp8 250 "${two[@]}" scripts/check_vllm_refit_tp2_gpu.py --model qwen3-30b-a3b --layers 4 --fp8 --out-dir "$RESULTS"
    ;;
  vllm-moe)
    step vllm_refit_qwen3-30b-a3b 280 python3 scripts/check_vllm_refit_gpu.py --model qwen3-30b-a3b --layers 4 --out-dir "$RESULTS"
    step vllm_refit_qwen3-30b-a3b_fp8 280 python3 scripts/check_vllm_refit_gpu.py --model qwen3-30b-a3b --layers 4 --fp8 --out-dir "$RESULTS"
    ;;
  vllm-deepseek)
    step vllm_refit_deepseek-v3-cut 240 python3 scripts/check_vllm_refit_gpu.py --model deepseek-v3-cut --out-dir "$RESULTS"
    step vllm_refit_deepseek-v3-cut_fp8 240 python3 scripts/check_vllm_refit_gpu.py --model deepseek-v3-cut --fp8 --out-dir "$RESULTS"
    ;;
  vllm-broadcast)
    engine_gpu=(); [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && engine_gpu=(--engine-gpu 1)
    step vllm_broadcast_qwen3-1.7b 270 python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-1.7b "${engine_gpu[@]}" --out-dir "$RESULTS"
    step vllm_broadcast_qwen3-1.7b_fp8 270 python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-1.7b --fp8 "${engine_gpu[@]}" --out-dir "$RESULTS"
    ;;
  vllm-broadcast-moe)
    engine_gpu=(); [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && engine_gpu=(--engine-gpu 1)
    step vllm_broadcast_qwen3-30b-a3b 270 python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-30b-a3b --layers 4 "${engine_gpu[@]}" --out-dir "$RESULTS"
    step vllm_broadcast_qwen3-30b-a3b_fp8 270 python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-30b-a3b --layers 4 --fp8 "${engine_gpu[@]}" --out-dir "$RESULTS"
    ;;
  vllm-bench-broadcast)
    # trainer GPU 0, engine GPU 1 over NCCL (NCCL's own defaults: no batch-invariant mode): ours, the raw
    # broadcast of the same bytes and vLLM's native nccl backend fed by stock, in rounds
    python3 -c "import ray" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/scripts/gpu/stubs
    # the library's defaults (512 MiB buckets, checksums on), then what the checksum and smaller buckets cost
    step bench_refit_vllm_broadcast_qwen3-1.7b 240 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-1.7b --out-dir "$RESULTS"
    step bench_refit_vllm_broadcast_qwen3-1.7b_nochecksum 240 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-1.7b --no-checksum --out-dir "$RESULTS"
    step bench_refit_vllm_broadcast_qwen3-1.7b_bucket256 240 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-1.7b --bucket-mib 256 --out-dir "$RESULTS"
    # the same 1 GiB per end in 4 buffers: 3 buckets in flight while one is packed or replayed
    step bench_refit_vllm_broadcast_qwen3-1.7b_bucket256_buffers4 240 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-1.7b --bucket-mib 256 --num-buffers 4 --out-dir "$RESULTS"
    step bench_refit_vllm_broadcast_qwen3-8b 300 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-8b --out-dir "$RESULTS"
    ;;
  vllm-bench-broadcast-8b)
    # the library's defaults at Qwen3-8B only (the step's rounds alternate the reset overlapped and after)
    python3 -c "import ray" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/scripts/gpu/stubs
    step bench_refit_vllm_broadcast_qwen3-8b 330 python3 scripts/bench_refit_vllm_broadcast.py --model qwen3-8b --out-dir "$RESULTS"
    ;;
  vllm-bench*)
    # vLLM's ipc backend imports ray and requests at module top; its callable transport (used here) needs
    # neither, and the wheelhouse has no ray: an empty stand-in module satisfies the import.
    python3 -c "import ray" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/scripts/gpu/stubs
    # the native backend sends torch types inside its update_info: vLLM pickles them only when allowed
    export VLLM_ALLOW_INSECURE_SERIALIZATION=1
    # 24 layers (29 GiB of weights, the trainer's and the engine's copies on one GPU) need an H200's memory;
    # on an 80 GB H100 both rows ran out of memory (2026-11-28): 12 layers there
    moe_layers=24
    [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)" -lt 100000 ] && moe_layers=12
    if [ "$part" = vllm-bench-moe ]; then
      step bench_refit_vllm_qwen3-30b-a3b_${moe_layers}layers 400 python3 scripts/bench_refit_vllm.py --model qwen3-30b-a3b --layers $moe_layers --steps 5 --out-dir "$RESULTS"
      exit
    fi
    if [ "$part" = vllm-bench-moe-fp8 ]; then  # BF16 weights quantized on the way into a block-FP8 engine
      step bench_refit_vllm_qwen3-30b-a3b_${moe_layers}layers_fp8 400 python3 scripts/bench_refit_vllm.py --model qwen3-30b-a3b --layers $moe_layers --fp8 --steps 5 --out-dir "$RESULTS"
      exit
    fi
    [ "$part" = vllm-bench-fp8 ] || step bench_refit_vllm_qwen3-8b 330 python3 scripts/bench_refit_vllm.py --model qwen3-8b --steps 5 --out-dir "$RESULTS"
    [ "$part" = vllm-bench-bf16 ] || step bench_refit_vllm_qwen3-8b_fp8 240 python3 scripts/bench_refit_vllm.py --model qwen3-8b --steps 5 --fp8 --out-dir "$RESULTS"
    ;;
  families)
    # Nemotron-H builds with mamba-ssm's Triton ops; its package imports a CUDA extension the wheelhouse leaves out
    export PYTHONPATH=$PYTHONPATH:$PWD/scripts/gpu/stubs
    step families_tp1 540 "${one[@]}" scripts/check_families_gpu.py --out-dir "$RESULTS"
    ;;
  moe-bench)
    step bench_qwen3-vl-30b-a3b_4layers 300 "${one[@]}" scripts/bench_export.py --model qwen3-vl-30b-a3b --layers 4 --from-checkpoint --steady 7 --out-dir "$RESULTS"
    step bench_qwen3-30b-a3b_4layers 200 "${one[@]}" scripts/bench_export.py --model qwen3-30b-a3b --layers 4 --steady 7 --out-dir "$RESULTS"
    ;;
  trainer-truth)
    step trainer_truth_tp1 200 "${one[@]}" scripts/check_trainer_truth_gpu.py --model qwen3-30b-a3b --layers 4 --out-dir "$RESULTS"
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      step trainer_truth_tp2 240 "${two[@]}" scripts/check_trainer_truth_gpu.py --model qwen3-30b-a3b --layers 4 --out-dir "$RESULTS"
      step bench_qwen3-30b-a3b_4layers_tp2_etp2 240 "${two[@]}" scripts/bench_export.py --model qwen3-30b-a3b --layers 4 --tp 2 --etp 2 --steady 5 --out-dir "$RESULTS"
    fi
    ;;
  training)
    # one data-parallel replica per GPU: with two, the deferred parameter all-gather really has shards to fetch
    step ddp_export 240 torchrun --nproc-per-node "$(nvidia-smi -L | wc -l)" scripts/check_ddp_export_gpu.py --out-dir "$RESULTS"
    # CPU ranks (gloo) on the GPU host's cores: TP2 on 2, 4 and 8 ranks = 1, 2 and 4 replicas writing in parallel
    step parallel_write 420 env CUDA_VISIBLE_DEVICES= python3 scripts/bench_parallel_write.py --ranks 2 4 8 --rounds 2 --work /tmp/pw --out-dir "$RESULTS"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
