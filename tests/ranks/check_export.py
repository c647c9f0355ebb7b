"""Per-rank checks of the export plan and the fast export; run under torchrun by test_export.py.

Usage: check_export.py --hf CKPT --result DIR [--tp N --pp N --vpp N --ep N]

Every rank loads the checkpoint into its shard of the model, then checks (failing with exit 1):
  * plan building moves no tensor data (tensor collectives counted by a test-only wrapper),
    runs at most two object collectives whatever the model's size, and allocates no tensor
    storage (a dispatch-mode allocation probe);
  * the plan of a model built on the meta device equals the plan of the real model;
  * the plan's (name, shape, dtype) list equals, in order, what RefitBridge yields and what the
    stock Megatron-Bridge export yields;
  * every yielded tensor equals the checkpoint on disk, bit for bit (the oracle), cache on and off;
  * with the cache on, a second export reuses the first export's buffers (same storage) and
    overwrites them; after the first call no new buffer is allocated;
  * each HF tensor reassembled from every rank's local shard by the plan's placements equals
    the exported tensor;
  * the layer map agrees with the layer modules of this rank's chunks.
Writes DIR/rank<R>.json with a few numbers for the test to read.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from rank_checks import fail, oracle, same_bytes
from torch.utils._python_dispatch import TorchDispatchMode

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags

TENSOR_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
)
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
# Plan building exchanges objects twice: the bridge's parameter names over the pipeline group and
# one RankContribution per rank; a count that grew with the model would show up here.
MAX_OBJECT_COLLECTIVES = 2


@contextlib.contextmanager
def count_collectives():
    """Test-only: wrap torch.distributed's tensor and object collectives with counters for the block.

    (The object collectives' own inner tensor gathers go through torch's module globals, not these
    attributes, so they are not counted as tensor collectives.)"""
    counts = {name: 0 for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES}
    originals = {name: getattr(dist, name) for name in counts}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return counted

    for name in counts:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class AllocationProbe(TorchDispatchMode):
    """Records the bytes of every tensor created by an aten factory op inside the block.

    Floating-point tensors (what weights are) count as ``bytes``; integer tensors (object
    collectives pickle into uint8 and exchange int64 sizes) count as ``object_bytes``.
    """

    FACTORIES = {
        "empty",
        "empty_strided",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "empty_like",
        "zeros_like",
        "clone",
        "cat",
    }

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.object_bytes = 0
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.overloadpacket.__name__ in self.FACTORIES
            and isinstance(out, torch.Tensor)
            and out.device.type != "meta"
        ):
            nbytes = out.numel() * out.element_size()
            if not out.is_floating_point():
                self.object_bytes += nbytes
            else:
                self.bytes += nbytes
                self.seen.append((func.overloadpacket.__name__, out.dtype, tuple(out.shape)))
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    add_layout_flags(parser)
    args = parser.parse_args()

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = layout_from_flags(args)
    cpu = torch.device("cpu")
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=5)):
        rank = dist.get_rank()
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, args.hf)

        # 1. plan: no tensor collectives, no storage.
        with count_collectives() as counts, AllocationProbe() as probe:
            plan = bridge.export_plan(chunks)
        if any(counts[name] for name in TENSOR_COLLECTIVES):
            fail(f"plan building ran tensor collectives: {counts}")
        if sum(counts[name] for name in OBJECT_COLLECTIVES) > MAX_OBJECT_COLLECTIVES:
            fail(f"plan building ran more than {MAX_OBJECT_COLLECTIVES} object collectives: {counts}")
        if probe.bytes:
            fail(f"plan building allocated {probe.bytes} bytes of floating-point tensor storage: {probe.seen[:8]}")
        if probe.object_bytes > 1 << 20:
            fail(f"plan building's object exchange used {probe.object_bytes} bytes (expected well under 1 MiB)")

        # 2. the same plan from a model built on the meta device.
        meta_bridge = RefitBridge.from_hf_pretrained(args.hf)
        meta_chunks = build_model(
            meta_bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16, materialize=False)
        )
        params = [p for c in meta_chunks for p in c.parameters()]
        off_meta = sum(p.numel() for p in params if p.device.type != "meta")
        if off_meta * 100 > sum(p.numel() for p in params):  # Megatron puts the final norm on CPU
            fail(f"meta build holds {off_meta} parameter elements off the meta device")
        if meta_bridge.export_plan(meta_chunks).to_json() != plan.to_json():
            fail("plan of the meta-device model differs from the plan of the real model")

        # 3. plan == fast export == stock export, in order; every tensor == checkpoint on disk.
        expected = [(e.hf_name, tuple(e.shape), e.torch_dtype) for e in plan.entries]
        read = oracle(args.hf)
        for cache in (False, True):
            got = []
            for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=cache):
                got.append((name, tuple(tensor.shape), tensor.dtype))
                if not same_bytes(tensor, read(name)):
                    fail(f"{name} (cache={cache}) differs from the checkpoint on disk")
            if got != expected:
                fail(f"export (cache={cache}) order/shape/dtype differs from the plan: {got[:3]} vs {expected[:3]}")
        stock = [(n, tuple(t.shape), t.dtype) for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)]
        if stock != expected:
            fail(
                f"stock export differs from the plan: stock {len(stock)} entries, plan {len(expected)}; "
                f"first difference {next((a, b) for a, b in zip(stock, expected) if a != b) if len(stock) == len(expected) else 'length'}"
            )

        # 4. cache: second call reuses and overwrites the first call's buffers.
        allocations_after_first = bridge.export_diagnostics().allocations
        first = {
            n: (t.data_ptr(), t)
            for n, t in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
        }
        params = {p.data_ptr() for c in chunks for p in c.parameters()}
        owned = [n for n, (ptr, _) in first.items() if _is_buffer_backed(ptr, params, chunks)]
        for name in owned:
            first[name][1].fill_(0)  # scribble on a cached buffer the caller wrongly kept
        second = {}
        for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
            second[name] = tensor.data_ptr()
            if not same_bytes(tensor, read(name)):
                fail(f"{name} differs from the checkpoint after the cached buffers were scribbled on")
        if any(first[n][0] != second[n] for n in first):
            fail("the second cached export yielded different storage than the first")
        allocations = bridge.export_diagnostics().allocations
        if allocations != allocations_after_first:
            fail(f"cached export allocated {allocations - allocations_after_first} new buffers after the first call")

        # 5. reassembly from placements.
        check_reassembly(bridge, chunks, plan, read)

        # 6. layer map from the chunks.
        from megatron.core import parallel_state as ps

        for vpp_stage, chunk in enumerate(chunks):
            for layer in chunk.decoder.layers:
                where = plan.layer_map.get(layer.layer_number - 1)
                if where != (ps.get_pipeline_model_parallel_rank(), vpp_stage):
                    fail(f"layer {layer.layer_number - 1}: layer map says {where}")

        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "entries": len(plan.entries),
                    "buffers_owned": len(owned),
                    "buffer_bytes": bridge.export_diagnostics().buffer_bytes,
                    "layer_map": {str(k): v for k, v in plan.layer_map.items()},
                    "ok": True,
                }
            )
        )


def _is_buffer_backed(ptr: int, param_ptrs: set[int], chunks) -> bool:
    """True when the tensor's storage is not inside any parameter (it is a bridge buffer)."""
    for chunk in chunks:
        for p in chunk.parameters():
            start = p.data_ptr()
            if start <= ptr < start + p.numel() * p.element_size():
                return False
    return True


def check_reassembly(bridge, chunks, plan, read) -> None:
    """Rebuild every HF tensor from each rank's local shard using only the plan's placements."""
    from megatron.core import parallel_state as ps

    params = {
        t.global_param_name: t.param_weight
        for t in bridge.megatron_model_bridge(chunks).build_conversion_tasks(bridge.hf_pretrained, chunks)
        if t is not None and t.param_weight is not None
    }
    tp_rank, ep_rank, pp_rank = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
    )
    etp_rank = ps.get_expert_tensor_parallel_rank()
    contributions = []
    for entry in plan.entries:
        if entry.alias_of is not None or entry.pp_rank != pp_rank:
            continue
        layout = entry.sharding
        if entry.is_expert:
            if layout.owner_ep_rank != ep_rank:
                continue
            pieces = layout.pieces[etp_rank if len(layout.pieces) > 1 else 0]
        else:
            pieces = layout.pieces[tp_rank if len(layout.pieces) > 1 else 0]
        local = params[entry.megatron_param]
        for copy in pieces:
            data = local.narrow(copy.dim, copy.local_start, copy.length).clone()
            contributions.append((entry.hf_name, copy.dim, copy.hf_start, data))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, contributions)
    if dist.get_rank() != 0:
        return
    rebuilt = {}
    for entry in plan.entries:
        if entry.alias_of is None:
            rebuilt[entry.hf_name] = torch.full(entry.shape, float("nan"), dtype=entry.torch_dtype)
    for rank_pieces in gathered:
        for name, dim, start, data in rank_pieces:
            rebuilt[name].narrow(dim, start, data.shape[dim]).copy_(data)
    for name, tensor in rebuilt.items():
        if not same_bytes(tensor, read(name)):
            fail(f"{name}: reassembly from the plan's placements differs from the checkpoint")


if __name__ == "__main__":
    main()
