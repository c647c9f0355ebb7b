"""Per-rank checker: the FP8 export stream through the packed broadcast (CPU, gloo, 2 ranks).

Rank 0 is the trainer (a Megatron model at TP1) and sends ``export_hf_weights(fp8="blockwise")``
with ``PackedBroadcastSender`` over a plan that includes the ``*_scale_inv`` entries; rank 1
receives with the same plan (sent as JSON) and compares every tensor with the reference
quantizer of tests/test_fp8.py applied to the checkpoint on disk. Writes DIR/result.json on rank 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402
from test_fp8 import KEEP, reference_quantize, same_bits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from mbridge_refit.convert.session import init_process_group, teardown
    from mbridge_refit.engines.broadcast.packed import (
        PackedBroadcastConfig,
        PackedBroadcastReceiver,
        PackedBroadcastSender,
    )
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.sinks import drain

    cpu = torch.device("cpu")
    init_process_group(device=cpu, timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, local_world_size=1)
    trainers, refit = dist.new_group([0]), dist.new_group([0, 1])
    config = PackedBroadcastConfig(bucket_bytes=64 * 1024, num_buffers=2, checksum=True)
    try:
        if rank == 0:
            from mbridge_refit.bridge import RefitBridge
            from mbridge_refit.models.builder import BuildOptions, build_model
            from mbridge_refit.plan.layout import ParallelLayout

            bridge = RefitBridge.from_hf_pretrained(args.hf)
            chunks = build_model(bridge, ParallelLayout(), BuildOptions(device=cpu, params_dtype=torch.bfloat16))
            bridge.load_hf_shards(chunks, args.hf)
            plan = bridge.export_plan(chunks, group=trainers, fp8="blockwise")
            payload = [plan.to_json()]
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=0, group=refit)
        if rank == 0:
            sender = PackedBroadcastSender(plan, config, group=refit, src=0, trainer_group=trainers)
            stream = bridge.export_hf_weights(
                chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"
            )
            drain(stream, sender)
            return
        plan = ExportPlan.from_json(payload[0])
        received = {
            name: t.clone()
            for name, t in PackedBroadcastReceiver(plan, config, group=refit, src=0, device=cpu).receive()
        }
        expected, fp8, differing = read_checkpoint(args.hf), KEEP, []
        for name, tensor in expected.items():
            if not fp8.quantizes(name, tuple(tensor.shape), "bfloat16"):
                differing += [] if same_bits(received[name], tensor) else [name]
                continue
            q, s = reference_quantize(tensor)
            if not (same_bits(received[name], q) and same_bits(received[name + "_scale_inv"], s)):
                differing.append(name)
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / "result.json").write_text(
            json.dumps(
                {
                    "names": sorted(received),
                    "expected_names": sorted(expected),
                    "differing": differing,
                    "scales": sum(n.endswith("_scale_inv") for n in received),
                    "plan_entries": len(plan.entries),
                }
            )
        )
    finally:
        teardown()


if __name__ == "__main__":
    main()
