"""Per-rank checks of the export inside a trainer as RL frameworks drive it; run under torchrun by
tests/test_trainer_truth.py (CPU, gloo).

Usage: trainer_truth_check.py --hf CKPT --result DIR --case CASE [--tp N ...]

Cases (each fails with exit 1 naming what differs; the oracle is the checkpoint on disk or the
stock Megatron-Bridge export of the same live model, never our own output):
  * ``changed-in-place``: the trainer's memory tricks and the consumer's hands after a cached
    export (issue 56), steps in sequence on one model (``IN_PLACE_STEPS``; ``--steps`` runs some):
    a same-address ``p.data = p.data.t()``; ``p.data = p.data.view(float16)`` / ``.half()`` on
    rank 0 only, refused on both ranks (``ModelChangedError`` there, ``CollectiveMisuseError`` on
    rank 1, each naming the parameter) before any collective; ``model.half()``, also with
    ``weight_dtype=torch.bfloat16``; a direct ``module._parameters[k] = new``; ``model.float()`` /
    ``.bfloat16()`` under ``set_overwrite_module_params_on_conversion(True)``, then a step; an
    offload by ``untyped_storage().resize_(0)`` loaded back by ``p.data = new`` or in place, refused
    while emptied; a consumer rebinding yielded views (the next export equals stock) and a yielded
    bridge-owned buffer (``ReboundOutputError`` naming it); such a buffer rebound after the loop on
    rank 1 only, refused on both ranks before any collective; ``p.data = p.data.clone()`` then
    ``release_export_buffers()`` frees the old storages; a deleted expert (parameter) is refused.
    Each export equals Megatron-Bridge's own export of the live model at that moment, or is refused.
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


_REFUSALS = ("ModelChangedError", "CollectiveMisuseError")


class _Trial:
    """One model under a bridge, exported after each change and held against stock's export of the
    live model at that moment (``expect_stock``), or refused by name (``expect_refused``)."""

    def __init__(self, bridge, chunks) -> None:
        self.bridge, self.chunks = bridge, chunks
        self.last_refusal = ""  # the message of the last refusal expect_refused saw
        # Megatron-Bridge's own model bridge, called directly: export_hf_weights_stock looks the
        # parameters up through the bridge's state first, which refuses a model the plan cannot read
        self.model_bridge = bridge.megatron_model_bridge(chunks)

    def ours(self, **kwargs):
        return self.bridge.export_hf_weights(self.chunks, show_progress=False, reuse_buffer_from_cache=True, **kwargs)

    def stock(self, **kwargs) -> dict[str, torch.Tensor]:
        stream = self.model_bridge.stream_weights_megatron_to_hf(
            self.chunks, self.bridge.hf_pretrained, cpu=False, show_progress=False, **kwargs
        )
        return {n: t.clone() for n, t in stream}

    def expect_stock(self, what: str, **kwargs) -> None:
        stock = self.stock(**kwargs)
        self._compare(what, stock, self.ours(**kwargs))

    def expect_refused(self, what: str, naming: str, kinds: tuple[str, ...] = _REFUSALS, **kwargs) -> str:
        try:
            for _ in self.ours(**kwargs):
                pass
        except Exception as err:  # by name: the same script runs against a tree without these classes
            self.last_refusal = str(err)
            return _check_refusal(what, err, naming, kinds)
        fail(f"{what}: exported, where it must be refused")

    def expect_stock_or_refused(self, what: str, naming: str, kinds: tuple[str, ...] = _REFUSALS, **kwargs) -> str:
        """Equal to stock, or refused by name: which one ("stock" or the error's class name)."""
        stock = self.stock(**kwargs)
        try:
            self._compare(what, stock, self.ours(**kwargs))
        except Exception as err:
            return _check_refusal(what, err, naming, kinds)
        return "stock"

    @staticmethod
    def _compare(what: str, stock: dict[str, torch.Tensor], ours) -> None:
        seen = set()
        for name, tensor in ours:
            if name not in stock or not same_bytes(tensor, stock[name]):
                fail(f"{what}: {name} differs from stock's export of the live model")
            seen.add(name)
        if seen != stock.keys():
            fail(f"{what}: stock exports {sorted(stock.keys() - seen)[:4]}, which this export did not yield")


def _check_refusal(what: str, err: Exception, naming: str, kinds: tuple[str, ...]) -> str:
    """``err``'s class name, after checking it is one of ``kinds`` and names ``naming``."""
    if type(err).__name__ not in kinds:
        fail(f"{what}: raised {type(err).__name__} where {' or '.join(kinds)} was expected: {err}")
    if naming not in str(err):
        fail(f"{what}: refused without naming {naming}: {err}")
    return type(err).__name__


def _plain_params(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if type(p) is torch.nn.Parameter]


def _from_rank(name: str | None, src: int = 0) -> str | None:
    """Rank ``src``'s ``name``, on every rank (what a one-rank change is made to)."""
    box = [name]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _short(name: str) -> str:
    """A parameter's name as an error names it on any stage: from its module on (no layer number)."""
    return ".".join(name.split(".")[-2:])


def step_transpose(trial: _Trial) -> dict:
    """Item 6: ``p.data = p.data.t()`` on a square weight keeps the address, changes the strides."""
    square = next((p for _, p in _plain_params(trial.chunks) if p.dim() == 2 and p.shape[0] == p.shape[1]), None)
    if square is None:
        return {"square": False}
    address = square.data_ptr()
    transposed = square.data.t()
    if transposed.data_ptr() != address:
        fail("the transpose moved the data: the case tests nothing")
    # The oracle: stock's export of the same values laid out contiguously. Stock broadcasts a
    # non-contiguous tensor to the other pipeline stages as its raw memory (gloo sends the storage
    # in memory order), so at PP 2 the receiving stage would get the weight untransposed.
    square.data = transposed.contiguous()
    stock = trial.stock()
    square.data = transposed
    trial._compare("after a square weight's .data = .data.t()", stock, trial.ours())
    square.data = square.data.t()
    trial.expect_stock("after the transpose is undone")
    return {"square": True}


def step_dtype_on_rank0(trial: _Trial) -> dict:
    """Items 1 and 6 on rank 0 only (at PP 2 the stage whose tensors rank 1 receives): a same-address
    ``.data.view(torch.float16)`` and a converting ``.data = .data.half()``; refused on both ranks,
    before any collective, naming the parameter."""
    params = dict(_plain_params(trial.chunks)) if dist.get_rank() == 0 else {}
    name = _from_rank(next((n for n in params if "linear_qkv.weight" in n), None))
    refused = {}
    for how, change in (("view", lambda t: t.view(torch.float16)), ("half", torch.Tensor.half)):
        if dist.get_rank() == 0:
            kept = params[name].data
            params[name].data = change(kept)
        refused[how] = trial.expect_refused(f"after {name}.data = {how} on rank 0", _short(name))
        if dist.get_rank() == 0:
            params[name].data = kept
        trial.expect_stock(f"after {name}'s data is back")
    return {"refused": sorted(set(refused.values()))}


def step_model_half(trial: _Trial) -> dict:
    """Item 1: ``model.half()`` (a ``.data`` swap of every parameter) after a cached export, exported as
    it is and with ``weight_dtype=torch.bfloat16`` (stock casts): equal to stock or refused by name."""
    trial.expect_stock("weight_dtype=bfloat16 before model.half()", weight_dtype=torch.bfloat16)
    kept = [(p, p.data) for _, p in _plain_params(trial.chunks)]
    for chunk in trial.chunks:
        chunk.half()
    verdicts = {
        "cast": trial.expect_stock_or_refused(
            "model.half(), weight_dtype=bfloat16", "float16", weight_dtype=torch.bfloat16
        ),
        "as_is": trial.expect_stock_or_refused("model.half()", "float16"),
    }
    for param, data in kept:
        param.data = data
    trial.expect_stock("after model.half() is undone", weight_dtype=torch.bfloat16)
    trial.expect_stock("after model.half() is undone")
    return verdicts


def step_parameters_write(trial: _Trial) -> dict:
    """Item 2: ``module._parameters[k] = new`` (no registration hook sees it), an expert's where the
    model has experts."""
    torch.manual_seed(dist.get_rank())
    names = [n for n, _ in _plain_params(trial.chunks) if "linear_fc1" in n]
    name = next((n for n in names if "expert" in n), names[0])
    chunk = next(c for c in trial.chunks if name in dict(c.named_parameters()))
    path, _, attr = name.rpartition(".")
    module = chunk.get_submodule(path)
    old = module._parameters[attr]
    module._parameters[attr] = torch.nn.Parameter(torch.randn_like(old, dtype=torch.float32).to(old.dtype))
    trial.expect_stock(f"after {name}: module._parameters[k] = new")
    return {"written": name}


def step_overwrite_conversion(trial: _Trial) -> dict:
    """Item 2: under ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, ``model.float()``
    then ``model.bfloat16()`` replace every parameter (``Module._apply`` writes ``_parameters``), then a
    training step changes the new ones in place."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = {id(p) for _, p in _plain_params(trial.chunks)}
        for chunk in trial.chunks:
            chunk.float()
        as_float = trial.expect_stock_or_refused("model.float() replacing the parameters", "float32")
        for chunk in trial.chunks:
            chunk.bfloat16()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    if before & {id(p) for _, p in _plain_params(trial.chunks)}:
        fail("the conversions kept parameter objects: the case tests nothing")
    with torch.no_grad():
        for _, param in _plain_params(trial.chunks):
            param.mul_(1.5).add_(0.25)
    trial.expect_stock("after model.float(), model.bfloat16() replaced the parameters and a step changed them")
    return {"float": as_float}


OFFLOAD_ROUNDS = 3


def step_offload(trial: _Trial) -> dict:
    """Item 3: an offload that empties every parameter's storage in place (``resize_(0)``), then loads
    it back by ``p.data = new tensor`` (which may land at the old address) or by refilling the storage;
    exported while emptied: refused by name, never a read of freed memory."""
    params = _plain_params(trial.chunks)
    saved = [p.detach().clone() for _, p in params]
    same_address = 0
    for round in range(OFFLOAD_ROUNDS):  # where a new storage lands is the allocator's choice: a few tries
        addresses = [p.data_ptr() for _, p in params]
        for (_, param), data in zip(params, saved):
            param.untyped_storage().resize_(0)
            fresh = torch.empty_like(data)
            fresh.copy_(data)
            param.data = fresh
        same_address += sum(p.data_ptr() == a for (_, p), a in zip(params, addresses))
        trial.expect_stock(f"after an offload emptied the storages and p.data = new tensor loaded them back ({round})")
    for _, param in params:
        param.untyped_storage().resize_(0)
    refused = trial.expect_refused("with the storages emptied", "cannot be read", kinds=("ModelChangedError",))
    if not any(_short(name) in trial.last_refusal for name, _ in params):
        fail(f"with the storages emptied: the refusal names no parameter: {trial.last_refusal}")
    for (_, param), data in zip(params, saved):
        param.untyped_storage().resize_(data.numel() * data.element_size())
        param.data.copy_(data)
    trial.expect_stock("after the emptied storages were refilled in place")
    return {"same_address": same_address, "refused": refused}


def step_consumer_rebinds(trial: _Trial) -> dict:
    """Item 4: a consumer rebinds yielded tensors (``t.data = ...``): views of parameters (the next
    export equals stock), then one from a bridge-owned buffer (the next export equals stock or raises
    ``ReboundOutputError`` naming it; after ``release_export_buffers`` it equals stock)."""
    storages = {p.untyped_storage().data_ptr() for _, p in _plain_params(trial.chunks)}
    views, buffers = 0, []
    for name, tensor in trial.ours():
        if tensor.untyped_storage().data_ptr() in storages:
            tensor.data = torch.zeros_like(tensor)
            views += 1
        else:
            buffers.append(name)
    trial.expect_stock("after the consumer rebound the yielded views of parameters")
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, buffers)
    target = next((n for n in buffers if all(n in b for b in everywhere)), None)  # the same tensor on every rank
    verdict = None
    if target is not None:
        what = f"after the consumer rebound {target}"
        try:  # a later tensor of the same export may reuse the buffer: refused there
            for name, tensor in trial.ours():
                if name == target:
                    tensor.data = tensor.data.half()
            verdict = trial.expect_stock_or_refused(what, target, kinds=("ReboundOutputError",))
        except Exception as err:
            verdict = _check_refusal(what, err, target, ("ReboundOutputError",))
        trial.bridge.release_export_buffers()
        trial.expect_stock("after release_export_buffers()")
    return {"views": views, "buffer": target, "verdict": verdict}


REFUSED_WITHIN_S = 20.0  # a refusal before any collective is a few store round trips; a rank left in a gather waits
# for the process group's timeout (5 minutes here)


def step_rebound_on_rank1(trial: _Trial) -> dict:
    """A consumer on rank 1 only rebinds a yielded bridge-owned buffer (``t.data = t.data.half()``)
    after the export's loop: the next export is refused on both ranks before any collective, naming
    the tensor (``ReboundOutputError`` on rank 1, ``CollectiveMisuseError`` carrying it on rank 0),
    within ``REFUSED_WITHIN_S``; after ``release_export_buffers()`` on both ranks it equals stock.
    The buffer is one the bridge yields as the same object every export (a gathered output; at PP 2
    rank 1's receive buffer of a stage-0 tensor), the tensor named the last one yielded from it."""
    storages = {p.untyped_storage().data_ptr() for _, p in _plain_params(trial.chunks)}
    first = {name: tensor for name, tensor in trial.ours()}
    last_name, target = {}, None
    for name, tensor in trial.ours():
        if first[name] is tensor and tensor.untyped_storage().data_ptr() not in storages:
            last_name[id(tensor)] = name  # a buffer reused for several tensors is named as the last one
            target = tensor if target is None else target
    named = _from_rank(last_name[id(target)] if dist.get_rank() == 1 and target is not None else None, src=1)
    if named is None:
        return {"buffer": None}
    if dist.get_rank() == 1:
        target.data = target.data.half()
    started = time.monotonic()
    kind = trial.expect_refused(
        f"after rank 1's consumer rebound {named}", named, kinds=("ReboundOutputError", "CollectiveMisuseError")
    )
    seconds = time.monotonic() - started
    store = dist.distributed_c10d._get_default_store()  # no collective: a rank left in a gather must not pair one
    store.set(f"rebound-on-rank1/{dist.get_rank()}", "1")
    try:
        store.wait([f"rebound-on-rank1/{r}" for r in range(dist.get_world_size())], datetime.timedelta(seconds=60))
    except Exception as err:
        fail(f"after rank 1's consumer rebound {named}: a rank did not return from the refused export ({err})")
    if seconds > REFUSED_WITHIN_S:
        fail(f"after rank 1's consumer rebound {named}: refused after {seconds:.1f} s, not before any collective")
    trial.bridge.release_export_buffers()
    trial.expect_stock(f"after rank 1's consumer rebound {named} and release_export_buffers()")
    return {"buffer": named, "refused": kind, "seconds": seconds}


def step_release(trial: _Trial) -> dict:
    """Item 5: ``p.data = p.data.clone()`` then ``release_export_buffers()`` frees the old storages."""
    from torch.multiprocessing.reductions import StorageWeakRef

    trial.expect_stock("before the swap")
    probes = []
    for _, param in _plain_params(trial.chunks):
        probes.append(StorageWeakRef(param.untyped_storage()))
        param.data = param.data.clone()
    trial.bridge.release_export_buffers()
    gc.collect()
    alive = sum(not probe.expired() for probe in probes)
    if alive:
        fail(f"{alive} of {len(probes)} swapped-out parameter storages are still alive after release_export_buffers()")
    trial.expect_stock("after the swap and the release")
    return {"freed": len(probes)}


def step_deleted(trial: _Trial) -> dict:
    """Item 7: a routed expert removed from its ``local_experts`` (a dense model: a parameter deleted)
    after the plan: on rank 0 only (refused on both ranks before any collective; put back: equal to
    stock), then on every rank (refused). Refused by name, never its old weights. Last: the model
    stays changed."""
    names = [n for n, _ in _plain_params(trial.chunks)]
    expert = next((n for n in names if ".local_experts." in n), None)
    if expert is not None:
        path, _, rest = expert.partition(".local_experts.")
        chunk = next(c for c in trial.chunks if expert in dict(c.named_parameters()))
        experts, index = chunk.get_submodule(f"{path}.local_experts"), int(rest.split(".")[0])
        removed = experts[index]

        def delete():
            del experts[index]

        def put_back():
            experts.insert(index, removed)

        naming = "local_experts."
    else:
        proj = next(n for n in names if "linear_proj.weight" in n)
        chunk = next(c for c in trial.chunks if proj in dict(c.named_parameters()))
        path, _, attr = proj.rpartition(".")
        module = chunk.get_submodule(path)
        removed = getattr(module, attr)

        def delete():
            delattr(module, attr)

        def put_back():
            setattr(module, attr, removed)

        naming = _short(proj)
    if dist.get_rank() == 0:
        delete()
    on_rank0 = trial.expect_refused("after a deletion on rank 0", naming)
    if dist.get_rank() == 0:
        put_back()
    trial.expect_stock("after the deleted one is put back")
    delete()
    return {
        "on_rank0": on_rank0,
        "deleted": trial.expect_refused("after a deletion", naming, kinds=("ModelChangedError",)),
    }


IN_PLACE_STEPS = {
    "transpose": step_transpose,
    "dtype-on-rank0": step_dtype_on_rank0,
    "model-half": step_model_half,
    "parameters-write": step_parameters_write,
    "overwrite-conversion": step_overwrite_conversion,
    "offload": step_offload,
    "consumer-rebinds": step_consumer_rebinds,
    "rebound-on-rank1": step_rebound_on_rank1,
    "release": step_release,
    "deleted": step_deleted,  # last: the model stays changed
}


def changed_in_place(args) -> dict:
    """The trainer's memory tricks and the consumer's hands after a cached export (issue 56), one step
    after another on one model (``--steps``: some of them): each export equals stock's of the live
    model or is refused by name on every rank."""
    layout = layout_from_flags(args)
    steps = args.steps.split(",") if args.steps else list(IN_PLACE_STEPS)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        trial = _Trial(bridge, chunks)
        trial.expect_stock("first export")
        trial.expect_stock("second export, nothing changed")
        return {step: IN_PLACE_STEPS[step](trial) for step in steps}


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
    parser.add_argument("--steps", default=None, help="changed-in-place: its steps to run, comma-separated (all)")
    args = parser.parse_args()
    report = CASES[args.case](args)
    args.result.mkdir(parents=True, exist_ok=True)
    rank = int(__import__("os").environ.get("RANK", "0"))
    (args.result / f"rank{rank}.json").write_text(json.dumps({"ok": True, **report}))


if __name__ == "__main__":
    main()
