#!/usr/bin/env bash
# Settle a ratio between two commits on one GPU host: bench_export.py of each, interleaved in one call.
#
#   bash scripts/gpu/ab_export.sh prepare OLD NEW        # here: git archives of both into ab/ (untracked, so it uploads)
#   bash ab/ab_export.sh run [ROUNDS] [-- BENCH ARGS]    # on the GPU host (after .gpu/p0/install.sh)
#
# `run` extracts every ab/*.tgz (a third, e.g. ab/base.tgz, may be added by hand) and runs, per round,
# the sides ORDER names (default "old new"; ORDER="new old" swaps them), each
# `torchrun --nproc-per-node 1 scripts/bench_export.py` from its own tree
# (default arguments: --model qwen3-8b --tp 1), writing each run's log as it ends and, at the end,
# one results.tgz of every run's JSON under $OUT (the device returns few files per call). The
# host's speed moves 2x between processes (bench_export.py's control loop), so compare runs of
# like control figures, or the medians of many. Delete ab/ before committing.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

prepare() {
  local root old new
  root="$(git -C "$here" rev-parse --show-toplevel)"
  old="$(git -C "$root" rev-parse --short "$1")" && new="$(git -C "$root" rev-parse --short "$2")" || exit 2
  mkdir -p "$root/ab"
  for pair in "old:$old" "new:$new"; do
    git -C "$root" archive --format=tar.gz -o "$root/ab/${pair%%:*}.tgz" "${pair#*:}" mbridge_refit scripts recipes
  done
  printf 'old=%s\nnew=%s\n' "$old" "$new" > "$root/ab/commits"
  cp "${BASH_SOURCE[0]}" "$root/ab/ab_export.sh"
  echo "ab/ holds old=$old new=$new; upload the tree and run: bash ab/ab_export.sh run"
}

run() {
  local rounds="${1:-1 2}"; shift || true
  [ "${1:-}" = "--" ] && shift
  local args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--model qwen3-8b --tp 1)
  cd "$here/.."
  for archive in ab/*.tgz; do side="$(basename "$archive" .tgz)"; mkdir -p "ab/$side" && tar -xzf "$archive" -C "ab/$side"; done
  cp ab/commits "$OUT/commits"
  for round in $rounds; do
    for side in ${ORDER:-old new}; do
      echo "=== $side round $round $(date +%T)"
      PYTHONPATH="$PWD/ab/$side" timeout "${PER_RUN:-200}" torchrun --nproc-per-node 1 "ab/$side/scripts/bench_export.py" \
        "${args[@]}" --out-dir "$OUT/runs/$side$round" > "$OUT/$side$round.log" 2>&1
      echo "rc=$? $(date +%T)"; grep -E "cache on|host CPU|bitwise" "$OUT/$side$round.log"
    done
  done
  (cd "$OUT" && tar czf results.tgz $(ls -d runs ./*.log commits 2>/dev/null) && rm -rf runs ./*.log)
}

case "${1:-}" in
  prepare) shift; [ $# -eq 2 ] || { echo "usage: $0 prepare OLD NEW" >&2; exit 2; }; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare OLD NEW | run [ROUNDS] [-- BENCH ARGS]" >&2; exit 2 ;;
esac
