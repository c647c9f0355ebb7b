"""Load an HF safetensors checkpoint into a Megatron model: each rank reads only its own slices.

Megatron-Bridge's stock loader reads each full tensor on one rank and scatters or broadcasts it,
which needs CUDA at TP>1 (``ReplicatedMapping`` moves to ``torch.cuda.current_device()``). Here
every rank reads, through ``safe_open(...).get_slice``, exactly the bytes of its own shard
(``placement.slice_copies``) and copies them into its parameters. Apart from the bridge's one
name exchange while building the conversion tasks, no collective runs, so it works on CPU with
gloo, on GPU, and for checkpoint conversion on machines without a GPU.

A stacked expert tensor ([E, ...]: GPT-OSS's, or a checkpoint that keeps experts packed) is read
one slot at a time: each rank reads the slots of its own experts and puts each back in the
parameter's layout (with expert tensor parallelism, its shard of it) through the same
``ExpertStack`` the export plan writes it with (``plan.stacking``, decided from the
checkpoint's stored shape as the export decides it).

Every parameter of every chunk must be written exactly once; anything left over is an error
that lists the parameter names (the model may have been built with ``to_empty``).

``check_hf_shapes`` runs the same walk without reading any data or writing any parameter: every
name and shape check of the load, on a model still on the meta device, so a checkpoint that does
not match its config is refused before the model is given memory.

A config that ties the output layer to the embedding (``tie_word_embeddings``) over a checkpoint
that stores an output weight of its own (``lm_head.weight``) is refused unless the two tensors are
equal (``check_tied_output``): the tied model has no output weight to load it into, so stock
Megatron-Bridge drops it and every export writes the embedding under its name. The check reads
only those two tensors, and only when the config ties and both are stored; it needs no process
group, so the command line runs it before one starts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from mbridge_refit.checkpoints.hf import HFCheckpoint
from mbridge_refit.errors import InputError
from mbridge_refit.plan.conversions import ELEMENTWISE_OPS, RELAYOUTS, relaid_shape
from mbridge_refit.plan.entries import expert_number
from mbridge_refit.plan.placement import placement_kind, slice_copies
from mbridge_refit.plan.slices import PlacementError, ShardContext, SliceCopy, hf_extents, place_column
from mbridge_refit.plan.stacking import stacked_placement
from mbridge_refit.runtime.progress import Progress, progress_bar

__all__ = [
    "LoadError",
    "LoadFailedElsewhere",
    "LoadReport",
    "TiedOutputError",
    "check_hf_shapes",
    "check_tied_output",
    "load_hf_shards",
]

logger = logging.getLogger(__name__)


class LoadError(InputError):
    """The checkpoint does not fit the model (missing tensor, wrong shape, uncovered parameter)."""


class LoadFailedElsewhere(LoadError):
    """Loading failed on another rank of this model; that rank's ``LoadError`` says why."""


class TiedOutputError(LoadError):
    """The config ties the output layer to the embedding, but the checkpoint stores an output weight
    of its own that differs from the embedding (the load would drop it)."""


@dataclass(kw_only=True, slots=True)
class LoadReport:
    """What a load did on this rank."""

    tensors_written: int = 0
    bytes_read: int = 0
    cast_from: dict[str, torch.dtype] = field(default_factory=dict)  # hf name -> checkpoint dtype, when cast


def load_hf_shards(
    model_bridge: Any,
    hf_pretrained: Any,
    chunks: list[torch.nn.Module],
    checkpoint: HFCheckpoint,
    *,
    show_progress: bool = False,
) -> LoadReport:
    """Fill every parameter of ``chunks`` from ``checkpoint``; call on every rank of the job.

    ``model_bridge`` is the bridge's MegatronModelBridge, ``hf_pretrained`` the object its tasks
    are built from (its ``state.source`` keys are checked against the mappings). Every checkpoint
    tensor must have exactly the shape the model needs (a larger one is refused, never cropped),
    and a tied model's checkpoint may store its output weight only as a copy of the embedding
    (``check_tied_output``: every rank reads the two tensors). Collective over Megatron's
    model-parallel group (one all-reduce at the end), so a ``LoadError`` on any rank of the model
    is raised on every one. With ``show_progress``, a progress bar of this rank's tensors (``runtime.progress``).
    """
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(chunks)
    _float32_router_state(unwrapped)
    report = _walk(model_bridge, hf_pretrained, unwrapped, checkpoint, read=True, show_progress=show_progress)
    if report.cast_from:
        logger.warning(
            "cast %d checkpoint tensors to the model's parameter dtype (e.g. %s)",
            len(report.cast_from),
            next(iter(report.cast_from.items())),
        )
    return report


def check_hf_shapes(
    model_bridge: Any, hf_pretrained: Any, chunks: list[torch.nn.Module], checkpoint: HFCheckpoint
) -> None:
    """Every check ``load_hf_shards`` makes (each tensor present with exactly the shape the model
    needs, every parameter covered), reading no tensor data and writing no parameter: ``chunks``
    may be on the meta device. The one check of the load that reads data, ``check_tied_output``,
    is not made here. Collective like ``load_hf_shards``; raises ``LoadError`` on every
    rank of the model if any rank's check fails."""
    from megatron.core.utils import unwrap_model

    _walk(model_bridge, hf_pretrained, unwrap_model(chunks), checkpoint, read=False)


def _walk(
    model_bridge: Any,
    hf_pretrained: Any,
    chunks: list[torch.nn.Module],
    checkpoint: HFCheckpoint,
    *,
    read: bool,
    show_progress: bool = False,
) -> LoadReport:
    """Check (and with ``read``, load) every parameter of ``chunks``; agree on failure across the model's ranks."""
    tasks = [t for t in model_bridge.build_conversion_tasks(hf_pretrained, chunks) if t is not None]
    report = LoadReport()
    written: set[int] = set()
    error: LoadError | None = None
    progress = progress_bar(len(tasks), desc="load", unit="tensor", show=show_progress)
    try:
        if read:
            check_tied_output(model_bridge, chunks[0].config, checkpoint)
        _load_tasks(
            tasks, model_bridge, chunks, chunks[0].config, checkpoint, report, written, read=read, progress=progress
        )
        _check_every_parameter_written(chunks, written)
    except LoadError as err:
        error = err
    finally:
        progress.close()
    _agree_on_failure(error)
    return report


def _load_tasks(
    tasks: list,
    model_bridge: Any,
    chunks: list[torch.nn.Module],
    config: Any,
    checkpoint: HFCheckpoint,
    report: LoadReport,
    written: set[int],
    *,
    read: bool = True,
    progress: Progress | None = None,
) -> None:
    with torch.no_grad():
        for task in tasks:
            if progress is not None:
                progress.update(1)
            if task.megatron_module is None or task.param_weight is None:
                continue  # the parameter lives on another pipeline stage
            if getattr(task.mapping, "is_grouped_export", False):
                _copy_expert_slot(task, config, checkpoint, report, read=read)
                written.add(id(task.param_weight))
                continue
            try:
                copies = slice_copies(task.mapping, task.megatron_module, task.param_weight, config)
                kind = placement_kind(task.mapping, task.megatron_module)
                extents = hf_extents(kind, _context(task, config))
            except PlacementError as err:
                raise LoadError(f"cannot load {task.global_param_name}: {err}") from err
            _copy_slices(
                task.param_weight,
                copies,
                extents,
                checkpoint,
                report,
                task.global_param_name,
                kind.elementwise_op,
                kind.relayout,
                read=read,
            )
            written.add(id(task.param_weight))
        for output_weight, embedding_copies, extents in _tied_output_copies(model_bridge, chunks, config):
            where = "output_layer.weight (tied)"
            _copy_slices(output_weight, embedding_copies, extents, checkpoint, report, where, read=read)
            written.add(id(output_weight))


def check_tied_output(model_bridge: Any, model_config: Any, checkpoint: HFCheckpoint) -> None:
    """Raise ``TiedOutputError`` where ``model_config`` (a Megatron config or provider) shares the
    embedding with the output layer and ``checkpoint`` stores both HF tensors the bridge maps them
    to (``model.embed_tokens.weight``, ``lm_head.weight``) with different contents (shape, dtype or
    bytes). Reads the two tensors, ``_COMPARED_BYTES`` of each at a time, only when the config ties
    and both are stored; no collective (every caller's rank reads the same files alike)."""
    if not getattr(model_config, "share_embeddings_and_output_weights", False):
        return
    for embedding, output in tied_output_names(model_bridge.mapping_registry()):
        stored = checkpoint.weight_map
        if embedding in stored and output in stored and not _same_stored_tensor(checkpoint, embedding, output):
            raise TiedOutputError(
                f"config.json of {checkpoint.path} sets tie_word_embeddings (the output layer is the embedding "
                f"{embedding!r}), but the checkpoint stores its own {output!r}, which differs from {embedding!r}: "
                f"loading would drop {output!r}, and every export would write the embedding under its name. Fix: "
                f'set "tie_word_embeddings": false in config.json if {output!r} is the model\'s output layer, or '
                f"drop {output!r} from the checkpoint if the model is tied"
            )


def tied_output_names(registry: Any) -> list[tuple[str, str]]:
    """``(embedding, output)`` HF names of each output layer the bridge's mapping ``registry`` maps
    (``<prefix>output_layer.weight``) beside the embedding of the same prefix, where the two differ
    (stock resolves the tied output's name so, ``MegatronModelBridge._get_tied_output_hf_name``)."""
    pairs = []
    for mapping in registry.mappings:
        megatron, output = mapping.megatron_param, mapping.hf_param
        if not (isinstance(megatron, str) and isinstance(output, str) and megatron.endswith(_OUTPUT_WEIGHT)):
            continue
        embedding = registry.megatron_to_hf_lookup(megatron[: -len(_OUTPUT_WEIGHT)] + _EMBEDDING_WEIGHT)
        if embedding is not None and isinstance(embedding.hf_param, str) and embedding.hf_param != output:
            pairs.append((embedding.hf_param, output))
    return pairs


_OUTPUT_WEIGHT = "output_layer.weight"
_EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
_COMPARED_BYTES = 64 * 2**20  # of each tensor per read: an embedding of a 150k vocabulary is ~1 GiB


def _same_stored_tensor(checkpoint: HFCheckpoint, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of ``checkpoint`` have the same shape, dtype and bytes (read in row blocks)."""
    shape, dtype = checkpoint.shape(a), checkpoint.dtype(a)
    if shape != checkpoint.shape(b) or dtype != checkpoint.dtype(b):
        return False
    if not shape:
        return torch.equal(_bits(checkpoint.tensor(a)), _bits(checkpoint.tensor(b)))
    row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
    rows = max(1, _COMPARED_BYTES // row_bytes)
    first, second = checkpoint.slice(a), checkpoint.slice(b)
    return all(
        torch.equal(_bits(first[start : start + rows]), _bits(second[start : start + rows]))
        for start in range(0, shape[0], rows)
    )


def _float32_router_state(chunks: list[torch.nn.Module]) -> None:
    """Switch routers' expert biases to float32 before loading, as Megatron-Core does before it
    loads a state dict (``TopKRouter._maintain_float32_expert_bias``, its load pre-hook; it keeps
    them in float32 while training): a checkpoint's float32 expert bias (ERNIE 4.5's
    ``e_score_correction_bias``) is then held as stored, not refused as a lossy cast to the model's
    bf16, and a bf16 one is widened exactly."""
    for chunk in chunks:
        for module in chunk.modules():
            maintain = getattr(module, "_maintain_float32_expert_bias", None)
            if callable(maintain):
                maintain()


def _agree_on_failure(error: LoadError | None) -> None:
    """Raise on every rank of this model replica if loading failed on any of them (one small
    all-reduce over Megatron's model-parallel group): a rank whose own slices were fine must not
    go on to the next gather and wait there for the failed one. Other replicas load the same
    slices and fail alike; ranks outside the model (e.g. refit receivers) take no part."""
    from megatron.core import parallel_state as ps

    failed = error is not None
    group = ps.get_model_parallel_group() if ps.model_parallel_is_initialized() else None
    if group is not None and dist.get_world_size(group) > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        if dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise LoadFailedElsewhere(
            "loading the checkpoint failed on another rank (its message names the tensor and the fix)"
        )


def _context(task: Any, config: Any) -> ShardContext:
    return ShardContext(
        local_shape=tuple(task.param_weight.shape),
        tp_rank=task.mapping.tp_rank,
        tp_size=task.mapping.tp_size,
        config=config,
    )


def _copy_slices(
    param: torch.Tensor,
    copies: Iterable[SliceCopy],
    extents: dict[str, tuple[int, int]],
    checkpoint: HFCheckpoint,
    report: LoadReport,
    where: str,
    elementwise_op: str | None = None,
    relayout: str | None = None,
    *,
    read: bool = True,
) -> None:
    """Copy each slice into ``param``; with ``elementwise_op``, its inverse is applied to the
    slice first, in the checkpoint's dtype (as the mapping's ``hf_to_megatron`` does). With a
    ``relayout`` the slices are of the stored tensor laid out back (``RELAYOUTS[relayout].load``),
    which is read whole (such tensors are small: a projector, a bias). Without ``read``, only the
    shapes are checked."""
    for copy in copies:
        _check_shape(copy, extents[copy.hf_name][1], param, checkpoint, where, relayout)
        if not read:
            continue
        source = (
            checkpoint.slice(copy.hf_name)
            if relayout is None
            else RELAYOUTS[relayout].load(checkpoint.tensor(copy.hf_name))
        )
        data = copy.read(source)
        if elementwise_op is not None:
            data = data.clone()
            ELEMENTWISE_OPS[elementwise_op].load(data)
        _write(param.narrow(copy.dim, copy.local_start, copy.length), data, copy.hf_name, checkpoint, report, where)


def _write(
    target: torch.Tensor, data: torch.Tensor, hf_name: str, checkpoint: HFCheckpoint, report: LoadReport, where: str
) -> None:
    """Copy ``data`` (read from ``hf_name``) into ``target``, a cast only where it keeps every value."""
    if data.dtype != target.dtype:
        _check_cast_is_exact(data, target.dtype, hf_name, checkpoint, where)
        report.cast_from[hf_name] = data.dtype
    target.copy_(data)
    report.tensors_written += 1
    report.bytes_read += data.numel() * data.element_size()


def _copy_expert_slot(
    task: Any, config: Any, checkpoint: HFCheckpoint, report: LoadReport, *, read: bool = True
) -> None:
    """Fill one expert's parameter from its slot of a stacked HF tensor [E, ...] (only that slot is
    read; without ``read``, only the shape is checked)."""
    param, where = task.param_weight, task.global_param_name
    hf_name = str(task.mapping.hf_param)
    if hf_name not in checkpoint.weight_map:
        raise LoadError(f"{where}: tensor {hf_name!r} is not in the checkpoint {checkpoint.path}")
    stored = tuple(checkpoint.shape(hf_name))
    try:
        _, stack = stacked_placement(
            task.mapping,
            tuple(param.shape),
            num_experts=config.num_moe_experts or 0,
            stored_shape=stored,
            partition_dim=getattr(param, "partition_dim", None),
        )
    except PlacementError as err:
        raise LoadError(f"cannot load {where}: {err}") from err
    expected = (stack.num_experts, *stack.expert_shape(tuple(param.shape)))
    if stored != expected:
        raise LoadError(
            f"checkpoint tensor {hf_name!r} in {checkpoint.path} has shape {list(stored)}, but this model ({where}) "
            f"needs {list(expected)} (all {stack.num_experts} experts stacked): the checkpoint does not match its "
            "config.json. Fix the config (num_experts, hidden_size, moe_intermediate_size) or use the checkpoint it belongs to."
        )
    if not read:
        return
    expert = expert_number(where)
    slot = checkpoint.slice(hf_name)[expert : expert + 1][0]
    whole = stack.read_from(slot)  # the whole expert; with expert tensor parallelism this rank keeps its shard
    _write(param, stack.shard_of(whole, task.mapping.tp_rank), hf_name, checkpoint, report, where)


def _check_shape(
    copy: SliceCopy,
    extent: int,
    param: torch.Tensor,
    checkpoint: HFCheckpoint,
    where: str,
    relayout: str | None = None,
) -> None:
    """The checkpoint tensor must have exactly the shape the model needs: its split dimension as long
    as all tensor-parallel ranks' slices together, every other dimension the local shard's (then
    relaid, with a ``relayout``). A larger tensor is refused, never cropped."""
    if copy.hf_name not in checkpoint.weight_map:
        raise LoadError(f"{where}: tensor {copy.hf_name!r} is not in the checkpoint {checkpoint.path}")
    hf_shape = tuple(checkpoint.shape(copy.hf_name))
    expected = tuple(extent if d == copy.dim else size for d, size in enumerate(param.shape))
    try:
        expected = relaid_shape(relayout, expected)
    except PlacementError as err:
        raise LoadError(f"cannot load {where}: {err}") from err
    if hf_shape != expected:
        raise LoadError(
            f"checkpoint tensor {copy.hf_name!r} in {checkpoint.path} has shape {list(hf_shape)}, but this model "
            f"({where}) needs {list(expected)}: the checkpoint does not match its config.json. Fix the config "
            "(e.g. vocab_size, hidden_size, intermediate_size, head counts) or use the checkpoint it belongs to."
        )


def _check_cast_is_exact(
    data: torch.Tensor, dtype: torch.dtype, hf_name: str, checkpoint: HFCheckpoint, where: str
) -> None:
    """A checkpoint tensor stored in another dtype than the model's parameter is accepted only if
    the cast keeps every value bit for bit (e.g. bf16 values saved as fp32): a lossy cast would
    change the weights silently, like a crop."""
    back = data.to(dtype).to(data.dtype)
    changed = int((_bits(back) != _bits(data)).reshape(max(back.numel(), 1), -1).any(dim=-1).sum())
    if changed:
        raise LoadError(
            f"checkpoint tensor {hf_name!r} in {checkpoint.path} is {_dtype_name(data.dtype)}, but this model ({where}) "
            f"keeps it as {_dtype_name(dtype)}, and the cast changes {changed} of the {data.numel()} values this rank reads: the model would "
            f'not hold the checkpoint\'s weights. Fix: set "dtype" in config.json to "{_dtype_name(data.dtype)}" '
            f"(the model then keeps {_dtype_name(data.dtype)} parameters), or save the checkpoint in {_dtype_name(dtype)}."
        )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so NaN payloads and -0 count as values)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tied_output_copies(model_bridge: Any, chunks: list[torch.nn.Module], config: Any):
    """With tied embeddings and PP>1 the last stage keeps its own copy of the embedding: fill it too.

    Found by parameter name (``<prefix>output_layer.weight``: a vision-language model's language
    model holds it under ``language_model.``), filled from the HF tensor of the same prefix's
    ``embedding.word_embeddings.weight``. At PP=1 the output layer has no weight of its own."""
    if not getattr(config, "share_embeddings_and_output_weights", False):
        return
    from megatron.core import parallel_state

    registry = model_bridge.mapping_registry()
    for chunk in chunks:
        for name, weight in chunk.named_parameters():
            if not name.endswith("output_layer.weight"):
                continue
            prefix = name[: -len("output_layer.weight")]
            owner = chunk.get_submodule(prefix.rstrip(".")) if prefix else chunk
            if getattr(owner, "pre_process", False):
                continue  # the first stage: the output layer reads the embedding parameter itself
            mapping = registry.megatron_to_hf_lookup(prefix + "embedding.word_embeddings.weight")
            if mapping is None:
                raise LoadError(
                    f"{name}: tied to an embedding the bridge maps no HF tensor to ({prefix}embedding.word_embeddings.weight)"
                )
            ctx = ShardContext(
                local_shape=tuple(weight.shape),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                config=config,
            )
            extent = ctx.tp_size * weight.shape[0]  # column-parallel rows of the embedding
            yield weight, place_column(str(mapping.hf_param), ctx), {str(mapping.hf_param): (0, extent)}


def _check_every_parameter_written(chunks: list[torch.nn.Module], written: set[int]) -> None:
    missing = [
        f"chunk {index}: {name}"
        for index, chunk in enumerate(chunks)
        for name, param in chunk.named_parameters()
        if id(param) not in written
    ]
    if missing:
        raise LoadError(
            f"{len(missing)} model parameters were not loaded from the checkpoint (no mapping or no HF tensor): "
            + ", ".join(missing[:20])
            + (" ..." if len(missing) > 20 else "")
        )
