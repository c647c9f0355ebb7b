"""Per-rank checks of the export inside a trainer as RL frameworks drive it; run under torchrun by
tests/test_trainer_truth.py (CPU, gloo).

Usage: trainer_truth_check.py --hf CKPT --result DIR --case CASE [--tp N ...]

Cases (each fails with exit 1 naming what differs; the oracle is the checkpoint on disk or the
stock Megatron-Bridge export of the same live model, never our own output):
  * ``changed-in-place``: after a cached export, a direct ``module._parameters[k] = new`` and a
    same-address ``p.data = p.data.t()`` export equal to stock; ``p.data = p.data.view(float16)``
    on rank 0 only is refused on both ranks (``ModelChangedError`` there, ``CollectiveMisuseError``
    on rank 1, each naming the parameter) before any collective; a deleted parameter is refused.
  * ``megatron-default-etp``: a MoE model built as a user builds it at TP 2: Megatron's parallel
    state and the provider's expert-TP left at their defaults (expert-TP = TP), so each routed
    expert is split in halves. The export (cache on and off, FP8) is on the fast path and equals
    the checkpoint and stock.
  * ``replaced-params``: after a first cached export, the model's parameters are replaced
    (``load_state_dict(assign=True)``, then ``param.data = ...``): every later export equals stock's
    export of the changed model; nothing is allocated when nothing changed; a deleted model's
    parameters are freed although the bridge lives on.
  * ``buckets``: the bucket API with one bucket per parameter and the cache on: a packer that keeps
    a whole bucket before sending it gets the checkpoint's bytes; the lifetime checking mode makes
    the same packing over the tensor-by-tensor API fail loudly.
  * ``lone-rank``: only rank 0 calls the export: it raises ``CollectiveMisuseError`` naming rank 1
    within the bridge's timeout instead of hanging.
  * ``early-exit``: rank 1 stops iterating after 3 tensors: rank 0 still gets the whole export and
    then ``CollectiveMisuseError`` naming rank 1; the next export on both ranks is exact.
  * ``overlapping-exports``: a second export started while the first is still open, the first then
    closed at different points on the two ranks (phase ``both``: both ranks overlap, the second by
    ``export_hf_weight_buckets``; ``one``: rank 1 drops its first export before the second, rank 0
    does not; ``waiting``: rank 1 finished its first export and waits in the second's handshake
    when rank 0 refuses it; ``another-bridge``: the second export is another bridge's, of the same
    model, and the first is closed 3 tensors later on rank 1): every rank raises
    ``CollectiveMisuseError`` naming the misuse and the fix, no collective pairs with the wrong
    partner, the stale exports close without a hang, and the next export equals stock's. Without
    the refusal, gloo pairs the first export's gathers with the second's (an error or an abort of
    the process) or the ranks wait for each other.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session, fail, oracle, same_bytes  # noqa: E402
from replica_check import check_fp8, check_stream  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402

CPU = torch.device("cpu")


def changed_in_place(args) -> dict:
    """Changes after a cached export that the plan must follow (equal to stock) or refuse by name on
    every rank (issue 56): a direct ``_parameters`` write, a same-address transpose, a dtype-changing
    ``.data`` view on rank 0 only, a deleted parameter."""
    from mbridge_refit.runtime.handshake import CollectiveMisuseError
    from mbridge_refit.runtime.live_params import ModelChangedError

    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):

        def expect_stock(what: str) -> None:
            stock = {n: t.clone() for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
            for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                if not same_bytes(tensor, stock[name]):
                    fail(f"{what}: {name} differs from stock's export of the live model")

        def expect_refused(what: str, naming: str) -> str:
            try:
                for _ in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                    pass
            except (ModelChangedError, CollectiveMisuseError) as err:
                if naming not in str(err):
                    fail(f"{what}: refused without naming {naming}: {err}")
                return type(err).__name__
            fail(f"{what}: exported, where it must be refused")

        expect_stock("first export")
        expect_stock("second export, nothing changed")
        torch.manual_seed(dist.get_rank())
        params = dict(chunks[0].named_parameters())
        fc1 = next(n for n in params if "linear_fc1" in n)
        path, _, attr = fc1.rpartition(".")
        module = chunks[0].get_submodule(path)
        old = module._parameters[attr]
        module._parameters[attr] = torch.nn.Parameter(torch.randn_like(old, dtype=torch.float32).to(old.dtype))
        expect_stock(f"after {fc1}: module._parameters[k] = new")
        square = next((n for n, p in params.items() if p.dim() == 2 and p.shape[0] == p.shape[1]), None)
        if square is not None:
            params[square].data = params[square].data.t()
            expect_stock(f"after {square}.data = .data.t()")
        qkv = next(n for n in params if "linear_qkv.weight" in n)
        if dist.get_rank() == 0:
            params[qkv].data = params[qkv].data.view(torch.float16)
        refused = expect_refused(f"after {qkv}.data = .data.view(float16) on rank 0", qkv.split("module.")[-1])
        if dist.get_rank() == 0:
            params[qkv].data = params[qkv].data.view(torch.bfloat16)
        expect_stock(f"after {qkv}'s dtype is back")
        proj = next(n for n in params if "linear_proj.weight" in n)
        path, _, attr = proj.rpartition(".")
        del chunks[0].get_submodule(path)._parameters[attr]
        deleted = expect_refused(f"after del {proj}", ".".join(proj.split(".")[-3:]))
        return {"square": square is not None, "refused": refused, "deleted": deleted}


def megatron_default_etp(args) -> dict:
    """TP 2 with Megatron-Core's own expert-TP default: experts split over the TP ranks."""
    from megatron.core import parallel_state

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import init_process_group, teardown
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    init_process_group(device=CPU, timeout=datetime.timedelta(minutes=5))
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # expert-TP left to Megatron
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        options = BuildOptions(
            device=CPU, params_dtype=torch.bfloat16, provider_overrides={"expert_tensor_parallel_size": None}
        )
        chunks = build_model(bridge, ParallelLayout(tp=2), options)
        if chunks[0].config.expert_tensor_parallel_size != 2:
            fail(
                f"the provider's default expert-TP is {chunks[0].config.expert_tensor_parallel_size}, expected the TP size 2"
            )
        bridge.load_hf_shards(chunks, args.hf)
        read = oracle(args.hf)
        plan = bridge.export_plan(chunks)
        names = {e.hf_name for e in plan.entries}
        split = [e.hf_name for e in plan.entries if e.is_expert and len(e.sharding.pieces) == 2]
        if not split:
            fail("no expert tensor is planned as split over the expert-TP ranks: the case tests nothing")
        for cache in (False, True, True):
            check_stream(
                bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=cache),
                read,
                names,
                f"BF16 cache={cache}",
            )
        stock = dict(bridge.export_hf_weights_stock(chunks, show_progress=False))
        for name, tensor in bridge.export_hf_weights(chunks, show_progress=False):
            if not same_bytes(tensor, stock[name]):
                fail(f"{name} differs from stock's export of the same model")
        diagnostics = bridge.export_diagnostics()
        if not diagnostics.planned or diagnostics.fallback_reason is not None:
            fail(f"expected the fast path, got {diagnostics}")
        check_fp8(
            bridge.export_hf_weights(chunks, show_progress=False, fp8="blockwise", reuse_buffer_from_cache=True),
            read,
            bridge.export_plan(chunks, fp8="blockwise"),
        )
        return {
            "expert_tp": chunks[0].config.expert_tensor_parallel_size,
            "tensors": len(names),
            "split_expert_tensors": len(split),
        }
    finally:
        teardown()


def replaced_params(args) -> dict:
    """Parameters replaced under a bridge that already exported the model."""
    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):

        def expect_stock(what: str) -> int:
            stock = {n: t.clone() for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
            count = 0
            for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                if not same_bytes(tensor, stock[name]):
                    fail(f"{what}: {name} differs from stock's export of the live model (stale weights)")
                count += 1
            return count

        expect_stock("first export")
        allocations = bridge.export_diagnostics().allocations
        expect_stock("second export, nothing changed")
        if bridge.export_diagnostics().allocations != allocations:
            fail("a steady-state export with no parameter change allocated new buffers")

        torch.manual_seed(dist.get_rank())  # each rank its own shard values
        state = {
            k: torch.randn_like(v, dtype=torch.float32).to(v.dtype) if v.is_floating_point() else v
            for k, v in chunks[0].state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        chunks[0].load_state_dict(state, strict=False, assign=True)
        replaced = sum(1 for n, p in chunks[0].named_parameters() if p.data_ptr() == state[n].data_ptr())
        if not replaced:
            fail("load_state_dict(assign=True) replaced no parameter: the case tests nothing")
        expect_stock("after load_state_dict(assign=True)")

        fc1 = [(n, p) for n, p in chunks[0].named_parameters() if "linear_fc1" in n]
        name, param = next(((n, p) for n, p in fc1 if "expert" in n), fc1[0])  # an expert's where there are experts
        param.data = torch.randn_like(param, dtype=torch.float32).to(param.dtype)
        expect_stock(f"after {name}.data = ...")

        return {"replaced": replaced, "freed": deleted_model_is_freed(bridge, layout, args.hf)}


def deleted_model_is_freed(bridge, layout, path: Path) -> bool:
    """A model the bridge exported (cached) and the caller then deleted is garbage-collected."""
    from mbridge_refit.models.builder import BuildOptions, build_model

    model = build_model(bridge, layout, BuildOptions(device=CPU, params_dtype=torch.bfloat16))
    bridge.load_hf_shards(model, path)
    for _ in bridge.export_hf_weights(model, show_progress=False, reuse_buffer_from_cache=True):
        pass
    probes = [weakref.ref(p) for p in model[0].parameters()]
    del model
    gc.collect()
    alive = sum(probe() is not None for probe in probes)
    if alive:
        holders = [type(r).__name__ for r in gc.get_referrers(next(p() for p in probes if p() is not None))]
        fail(f"{alive} of {len(probes)} parameters of a deleted model are still alive, held by {holders[:6]}")
    return True


def buckets(args) -> dict:
    from mbridge_refit.runtime.lifetime import ExpiredTensorError

    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        bridge.bucket_bytes = 0  # one bucket per parameter: the most buffer reuse
        read = oracle(args.hf)
        names = {e.hf_name for e in bridge.export_plan(chunks).entries}
        sent, count = {}, 0
        for _ in range(2):
            for bucket in bridge.export_hf_weight_buckets(chunks, show_progress=False, reuse_buffer_from_cache=True):
                packed = list(bucket)  # the packer keeps the bucket's tensors, then sends them together
                count += 1
                for name, tensor in packed:
                    sent[name] = tensor.clone()
            for name in names:
                if not same_bytes(sent[name], read(name)):
                    fail(f"bucket API: {name} differs from the checkpoint")
        check_stream(
            _flatten(
                bridge.export_hf_weight_buckets(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8=None)
            ),
            read,
            names,
            "bucket API, flattened",
        )
        check_fp8(
            _flatten(
                bridge.export_hf_weight_buckets(
                    chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"
                )
            ),
            read,
            bridge.export_plan(chunks, fp8="blockwise"),
        )

        bridge.check_lifetime = True
        kept = list(
            bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
        )  # the wrong pattern
        try:
            kept[0][1].sum()
        except ExpiredTensorError as err:
            message = str(err)
        else:
            fail("a tensor kept past its lifetime was read without an error in the checking mode")
        if kept[0][0] not in message:
            fail(f"the lifetime error does not name the tensor: {message}")
        return {"buckets": count}


def _flatten(buckets):
    for bucket in buckets:
        yield from bucket


def lone_rank(args) -> dict:
    from mbridge_refit.runtime.handshake import CollectiveMisuseError

    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        bridge.collective_timeout_s = 5.0
        list(bridge.export_hf_weights(chunks, show_progress=False))  # both ranks: the plan exists
        result = {}
        if dist.get_rank() == 0:
            started = time.monotonic()
            try:
                list(bridge.export_hf_weights(chunks, show_progress=False))
            except CollectiveMisuseError as err:
                result = {"error": str(err), "seconds": time.monotonic() - started}
            else:
                fail("an export called on rank 0 alone did not raise")
            if "rank(s) [1]" not in result["error"] or "collective" not in result["error"]:
                fail(f"the error does not name the missing rank and the contract: {result['error']}")
        dist.barrier()
        return result


def early_exit(args) -> dict:
    from mbridge_refit.runtime.handshake import CollectiveMisuseError

    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        bridge.collective_timeout_s = 30.0
        read = oracle(args.hf)
        names = {e.hf_name for e in bridge.export_plan(chunks).entries}
        result = {}
        if dist.get_rank() == 1:
            for index, _ in enumerate(
                bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
            ):
                if index == 2:
                    break
        else:
            try:
                check_stream(
                    bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True),
                    read,
                    names,
                    "peer",
                )
            except CollectiveMisuseError as err:
                result["error"] = str(err)
            else:
                fail("rank 1 left the export early, and rank 0 was not told")
            if "rank 1 stopped iterating after 3 item(s)" not in result["error"]:
                fail(f"the error does not name the rank that left: {result['error']}")
        check_stream(
            bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True),
            read,
            names,
            "next export",
        )
        return result


def overlapping_exports(args) -> dict:
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.runtime.handshake import CollectiveMisuseError

    layout = layout_from_flags(args)
    with checkpoint_session(args.hf, layout, timeout=datetime.timedelta(seconds=90)) as (bridge, chunks):
        rank, tensors = dist.get_rank(), len(bridge.export_plan(chunks).entries)
        result = {}

        def refused(phase: str, start) -> None:
            """Start the second export (``start``); it must raise, naming the misuse and the fix."""
            started = time.monotonic()
            try:
                second = start()
            except CollectiveMisuseError as err:
                result[phase] = {"error": str(err), "seconds": time.monotonic() - started}
            else:  # what happens without the refusal: the ranks go on in different orders
                if rank == 0:
                    first.close()
                list(second)
                fail(f"phase {phase}: a second export started while the first was open was not refused")
            needles = ["still open", "refused on every rank", "close()", "Finish or close the first export"]
            if rank == 1 and phase not in ("both", "another-bridge"):
                needles.append("rank 0 refused it")  # the verdict of the rank that saw the overlap
            if phase == "another-bridge":
                needles.append("of this bridge or another")
            if not all(needle in result[phase]["error"] for needle in needles):
                fail(f"phase {phase}: the error does not name the misuse and the fix: {result[phase]['error']}")

        # both: every rank overlaps; rank 1 closes its first export later than rank 0
        first = iter(bridge.export_hf_weights(chunks, show_progress=False))
        for _ in range(3):
            next(first)
        refused("both", lambda: bridge.export_hf_weight_buckets(chunks, show_progress=False))
        if rank == 1:
            time.sleep(1.0)
        first.close()  # runs the rest of the first export, with the peer's close

        # one: rank 1 drops its first export (closed by the refcount: the rest runs with rank 0's close)
        first = iter(bridge.export_hf_weight_buckets(chunks, show_progress=False))
        next(first)
        if rank == 1:
            del first
        refused("one", lambda: bridge.export_hf_weights(chunks, show_progress=False))
        if rank == 0:
            first.close()

        # waiting: rank 0 takes every tensor without ending the generator; rank 1 ends it and waits in
        # the second export's handshake until rank 0's refusal wakes it
        first = iter(bridge.export_hf_weights(chunks, show_progress=False))
        if rank == 0:
            for _ in range(tensors):
                next(first)
            time.sleep(2.0)
        else:
            sum(1 for _ in first)
        refused("waiting", lambda: bridge.export_hf_weights(chunks, show_progress=False))
        first.close()

        # another-bridge: the second export is another bridge's (of the same model); the first is
        # closed 3 tensors later on rank 1 than on rank 0
        other = RefitBridge.from_hf_pretrained(args.hf)
        first = iter(bridge.export_hf_weights(chunks, show_progress=False))
        for _ in range(3):
            next(first)
        refused("another-bridge", lambda: other.export_hf_weights(chunks, show_progress=False))
        for _ in range(3 if rank == 1 else 0):
            next(first)  # with rank 0's close
        first.close()

        ours = [(name, tensor.clone()) for name, tensor in bridge.export_hf_weights(chunks, show_progress=False)]
        stock = [(name, tensor.clone()) for name, tensor in bridge.export_hf_weights_stock(chunks, show_progress=False)]
        if [name for name, _ in ours] != [name for name, _ in stock]:
            fail("the export after the refusals does not yield stock's names in stock's order")
        differing = [name for (name, a), (_, b) in zip(ours, stock) if not same_bytes(a, b)]
        if differing:
            fail(f"the export after the refusals differs from stock's: {differing[:5]}")
        return {**result, "tensors": len(ours)}


CASES = {
    "changed-in-place": changed_in_place,
    "megatron-default-etp": megatron_default_etp,
    "replaced-params": replaced_params,
    "buckets": buckets,
    "lone-rank": lone_rank,
    "early-exit": early_exit,
    "overlapping-exports": overlapping_exports,
}


def main() -> None:
    parser = checker_parser()
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    args = parser.parse_args()
    report = CASES[args.case](args)
    args.result.mkdir(parents=True, exist_ok=True)
    rank = int(__import__("os").environ.get("RANK", "0"))
    (args.result / f"rank{rank}.json").write_text(json.dumps({"ok": True, **report}))


if __name__ == "__main__":
    main()
