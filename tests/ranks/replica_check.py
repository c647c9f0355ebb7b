"""Per-rank checks of exports with data- and context-parallel replicas; run under torchrun by
tests/test_replicas.py (CPU, gloo).

Usage: replica_check.py --hf CKPT --result DIR [--tp N --pp N --vpp N --cp N --ep N]

The world is any multiple of tp*pp*cp; the ranks beyond one replica are data-parallel replicas.
Every rank loads the checkpoint into its shard, then checks against the checkpoint on disk
(tests/oracle.py), failing with exit 1:
  * the plan's (name, shape, dtype) set is the checkpoint's, the same on every rank;
  * the export on every rank (stock contract): every tensor equals the checkpoint bit for bit;
  * ``export_hf_weights(replica=0)``: the participating ranks get the full stream, equal to the
    checkpoint; every other rank gets nothing (at DP > 1 without cross-replica expert groups,
    the other replica takes no part); a second call gives the same;
  * the FP8 export: every quantized weight and scale equals the reference quantizer of
    tests/test_fp8.py applied to the checkpoint's tensor; kept tensors equal the checkpoint;
  * ``export_hf_weights(only=...)``, BF16 and FP8, each replica a different share (as the
    parallel checkpoint write): exactly the share, in plan order, equal to the checkpoint.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session, fail, oracle, same_bytes  # noqa: E402
from test_fp8 import reference_quantize, same_bits  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402


def check_stream(stream, read, names: set[str], what: str) -> int:
    seen = set()
    for name, tensor in stream:
        if not same_bytes(tensor, read(name)):
            fail(f"{what}: {name} differs from the checkpoint on disk")
        seen.add(name)
    if seen != names:
        fail(
            f"{what}: names differ from the checkpoint: missing {sorted(names - seen)[:5]}, extra {sorted(seen - names)[:5]}"
        )
    return len(seen)


def check_fp8(stream, read, plan) -> int:
    quantized = {e.scale_of for e in plan.entries if e.scale_of is not None}
    expected = fp8_expectation(plan, read)
    count = 0
    for name, tensor in stream:
        if not same_bits(tensor, expected(name)):
            fail(f"FP8 export: {name} differs from the reference quantizer applied to the checkpoint")
        count += 1
    if count != len(plan.entries) or not quantized:
        fail(f"FP8 export yielded {count} tensors, plan has {len(plan.entries)} ({len(quantized)} quantized)")
    return count


def check_only(bridge, chunks, plan, fp8_plan, read, replica: int, replicas: int) -> dict:
    """Each replica exports a different share (``only=``), as the parallel checkpoint write does:
    exactly those names, in plan order, each equal to the checkpoint (FP8: to the reference)."""
    disjoint = sum(len(r) for r in bridge.replica_ranks(chunks)) == dist.get_world_size()
    share = replica if disjoint else 0  # replicas that share expert groups must export alike
    counts = {}
    for fp8, entries in ((None, plan.entries), ("blockwise", fp8_plan.entries)):
        expected = fp8_expectation(fp8_plan, read) if fp8 else read
        wanted = [e.hf_name for i, e in enumerate(entries) if i % max(replicas, 2) == share]
        got = []
        for name, tensor in bridge.export_hf_weights(
            chunks, show_progress=False, reuse_buffer_from_cache=True, fp8=fp8, only=wanted
        ):
            got.append(name)
            if not same_bits(tensor, expected(name)):
                fail(f"only= export ({fp8 or 'bf16'}): {name} differs from the checkpoint (or the reference quantizer)")
        if got != wanted:
            fail(f"only= export ({fp8 or 'bf16'}) yielded {got[:4]}..., wanted {wanted[:4]}... in plan order")
        counts[fp8 or "bf16"] = len(got)
    return {"disjoint": disjoint, **counts}


def fp8_expectation(fp8_plan, read):
    """name -> what the FP8 export must yield for it, from the checkpoint and the reference quantizer."""
    scales = {e.hf_name: e.scale_of for e in fp8_plan.entries if e.scale_of is not None}
    quantized = set(scales.values())

    def expected(name):
        if name in scales:
            return reference_quantize(read(scales[name]))[1]
        return reference_quantize(read(name))[0] if name in quantized else read(name)

    return expected


def main() -> None:
    parser = checker_parser()
    args = parser.parse_args()
    layout = layout_from_flags(args)

    from megatron.core import parallel_state as ps

    read = oracle(args.hf)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        rank, world = dist.get_rank(), dist.get_world_size()

        plan = bridge.export_plan(chunks)
        names = {e.hf_name for e in plan.entries}
        signature = sorted((e.hf_name, tuple(e.shape), e.dtype) for e in plan.entries)
        on_disk = sorted((n, tuple(read(n).shape), str(read(n).dtype).removeprefix("torch.")) for n in names)
        if signature != on_disk:
            fail("plan names/shapes/dtypes differ from the checkpoint")
        everyone = [None] * world
        dist.all_gather_object(everyone, signature)
        if any(s != signature for s in everyone):
            fail("ranks disagree on the plan")

        exported = check_stream(
            bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True),
            read,
            names,
            "export on every rank",
        )

        takes_part = bridge.takes_part(chunks, 0)
        for attempt in range(2):  # a yielded tensor is valid until the generator advances: check as it comes
            stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, replica=0)
            if takes_part:
                check_stream(stream, read, names, f"replica 0 export (call {attempt + 1})")
            elif count := sum(1 for _ in stream):
                fail(f"rank {rank} is not needed by replica 0 but got {count} tensors")
        if ps.get_data_parallel_rank() == 0 and not takes_part:
            fail("a rank of replica 0 does not take part in replica 0's export")

        fp8_plan = bridge.export_plan(chunks, fp8="blockwise")
        fp8_count = check_fp8(
            bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"),
            read,
            fp8_plan,
        )

        only = check_only(
            bridge, chunks, plan, fp8_plan, read, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        )

        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "replica": ps.get_data_parallel_rank(),
                    "dp": ps.get_data_parallel_world_size(),
                    "cp": ps.get_context_parallel_world_size(),
                    "exported": exported,
                    "takes_part_in_replica0": takes_part,
                    "fp8_tensors": fp8_count,
                    "only": only,
                    "ok": True,
                }
            )
        )


if __name__ == "__main__":
    main()
