"""The export-to-checkpoint path that ``roundtrip`` and ``export`` share.

``write_hf_checkpoint`` builds the output dtypes (the source checkpoint's, or with FP8 the e4m3
weights, their scales and a ``quantization_config``), then drains ``RefitBridge.export_hf_weights``
into a ``ShardedSafetensorsWriter``. Collective: every rank of the job calls it.

Replicas write in parallel. The files are fixed before the export from its plan (a
``ShardAssignment``: the same greedy shards as a streamed write, so the output does not depend on
the world size). Shard ``k`` is written by data-parallel replica ``k % dp``, and each replica
exports only the tensors of its own shards (``export_hf_weights(only=...)``): with ``dp``
replicas each runs about ``1/dp`` of the gathers and writes. Where replicas share ranks (expert
parallelism carved across them) every replica exports everything and the shards are spread over
all ranks. A model without a plan (stock fallback) is streamed as it comes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.fp8.format import FP8_DTYPE, BlockwiseFP8Config, FP8FormatError
from mbridge_refit.plan.entries import ExportPlan, PlanError
from mbridge_refit.sinks import ShardAssignment, ShardedSafetensorsWriter, drain

if TYPE_CHECKING:
    import torch

    from mbridge_refit.bridge import RefitBridge

__all__ = [
    "Stream",
    "WriteShare",
    "cast_to_dtypes",
    "matching_source",
    "output_dtypes",
    "planned_share",
    "warn_unwritten",
    "write_hf_checkpoint",
    "written_tensors",
]

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteShare:
    """This rank's part of a planned checkpoint write."""

    assignment: ShardAssignment  # every file and its writer (the same on every rank)
    names: frozenset[str] | None  # what this rank's replica exports (None: everything)
    parallel_replicas: int  # replicas exporting disjoint shares (1: every rank exports everything)


def write_hf_checkpoint(
    bridge: RefitBridge,
    chunks: list,
    *,
    out: Path,
    source_dtypes: Mapping[str, "torch.dtype"],
    fp8: BlockwiseFP8Config | None,
    only_source_names: bool,
    copy_files_from: Path,
    max_shard_bytes: int,
    overwrite: bool,
    show_progress: bool,
) -> int:
    """Export ``chunks`` into an HF checkpoint at ``out``; returns the tensors the checkpoint holds.

    ``only_source_names``: write only the names of ``source_dtypes`` (an export from a Megatron
    checkpoint, whose config-only bridge also yields e.g. a tied ``lm_head.weight`` the source
    did not store); every source name must be exported. Otherwise every exported tensor is
    written, in the source's dtype where the source has it.
    """
    start = time.monotonic()
    dtypes, config_overrides = output_dtypes(bridge, chunks, source_dtypes, fp8)
    share = planned_share(
        bridge, chunks, dtypes, fp8=fp8, only_source_names=only_source_names, max_shard_bytes=max_shard_bytes
    )
    sink = ShardedSafetensorsWriter(
        out_dir=out,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        copy_files_from=copy_files_from,
        config_overrides=config_overrides,
        assignment=share.assignment if share is not None else None,
    )
    try:  # from here on a failure or an interrupt aborts the sink (the export's start runs before drain)
        if share is None:  # no plan: the stock export, streamed
            stream = bridge.export_hf_weights(chunks, show_progress=show_progress, fp8=fp8)
            adapted = matching_source(stream, dtypes) if only_source_names else cast_to_dtypes(stream, dtypes)
            written: list[str] = []
            count = drain(_recording_names(adapted, written), sink)
            warn_unwritten(source_dtypes, written)
        else:
            stream = bridge.export_hf_weights(chunks, show_progress=show_progress, fp8=fp8, only=share.names)
            drain(cast_to_dtypes(stream, dtypes), sink)
            count = len(share.assignment.names)
    except BaseException:
        sink.abort()  # drain's abort, where it ran, made this one do nothing
        raise
    replicas = share.parallel_replicas if share is not None else 1
    logger.info(
        "export+write: %d tensors in %.3f s, of which %.3f s writing and syncing this rank's shard files "
        "(%d replica%s writing in parallel)",
        count,
        time.monotonic() - start,
        sink.file_seconds,
        replicas,
        "s" if replicas > 1 else "",
    )
    return count


def _recording_names(stream: Stream, names: list[str]) -> Iterator[tuple[str, "torch.Tensor"]]:
    for name, tensor in stream:
        names.append(name)
        yield name, tensor


def warn_unwritten(source_dtypes: Mapping[str, "torch.dtype"], written: list[str]) -> None:
    """Warn, naming them, about tensors of the source checkpoint the output lacks: no mapping of the
    bridge reads them (a plan covers every source tensor or the export falls back to stock, which
    drops them without a word; e.g. a vision tower's pooling head the Megatron model does not have)."""
    import torch.distributed as dist

    missing = sorted(set(source_dtypes) - set(written))
    if missing and (not dist.is_initialized() or dist.get_rank() == 0):  # every rank wrote the same stream
        logger.warning(
            "the output lacks %d tensors of the source checkpoint, which no mapping of the bridge reads: %s%s",
            len(missing),
            missing[:10],
            " ..." if len(missing) > 10 else "",
        )


def planned_share(
    bridge: RefitBridge,
    chunks: list,
    dtypes: Mapping[str, "torch.dtype"],
    *,
    fp8: BlockwiseFP8Config | None,
    only_source_names: bool,
    max_shard_bytes: int,
) -> WriteShare | None:
    """The files of the checkpoint and this rank's share of them, from the export plan; None for
    a model without a plan. Collective on the first call for a model (plan, replica ranks)."""
    import torch.distributed as dist

    try:
        plan = bridge.export_plan(chunks, fp8=fp8)
    except PlanError:
        return None
    tensors = written_tensors(plan, dtypes, only_source_names=only_source_names)
    replicas = bridge.replica_ranks(chunks)
    disjoint = sum(len(r) for r in replicas) == len(set().union(*replicas))
    groups = replicas if disjoint else [frozenset(range(dist.get_world_size()))]
    assignment = ShardAssignment.build(tensors, max_shard_bytes=max_shard_bytes, replicas=groups)
    mine = next(ranks for ranks in groups if dist.get_rank() in ranks)
    if len(groups) > 1:
        names = assignment.names_for(mine)
    else:  # every rank exports what the checkpoint holds (the export may yield more, e.g. a tied lm_head)
        names = frozenset(assignment.names) if len(assignment.names) < len(plan.entries) else None
    return WriteShare(assignment=assignment, names=names, parallel_replicas=len(groups))


def written_tensors(
    plan: ExportPlan, dtypes: Mapping[str, "torch.dtype"], *, only_source_names: bool
) -> list[tuple[str, int]]:
    """``(name, bytes in the file)`` of every tensor the checkpoint holds, in export order."""
    entries = [e for e in plan.entries if not only_source_names or e.hf_name in dtypes]
    if only_source_names:
        missing = sorted(set(dtypes) - {e.hf_name for e in entries})
        if missing:
            raise BadInput(
                f"the model exports no tensor for {len(missing)} names of the source checkpoint (e.g. {missing[:5]}): "
                "its stored config does not describe its weights; re-import it from the HF checkpoint it came from"
            )
        skipped = [e.hf_name for e in plan.entries if e.hf_name not in dtypes]
        if skipped:
            logger.info(
                "not writing %d exported tensors the source checkpoint did not store: %s", len(skipped), skipped[:10]
            )
    return [(e.hf_name, math.prod(e.shape) * dtypes.get(e.hf_name, e.torch_dtype).itemsize) for e in entries]


def matching_source(stream: Stream, dtypes: Mapping[str, "torch.dtype"]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The stream without the names ``dtypes`` lacks, in their dtypes; raises if a name of
    ``dtypes`` never came (the stock-fallback path of ``only_source_names``)."""
    seen: set[str] = set()
    for name, tensor in cast_to_dtypes(stream, dtypes):
        if name in dtypes:
            seen.add(name)
            yield name, tensor
    missing = sorted(set(dtypes) - seen)
    if missing:
        raise ValueError(
            f"the export yielded no tensor for {len(missing)} names of the source checkpoint: {missing[:20]}"
        )


def cast_to_dtypes(stream: Stream, dtypes: Mapping[str, "torch.dtype"]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Give every exported tensor named in ``dtypes`` that dtype (a no-op when they agree)."""
    for name, tensor in stream:
        dtype = dtypes.get(name)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def output_dtypes(
    bridge: RefitBridge, chunks: list, source_dtypes: Mapping[str, "torch.dtype"], fp8: BlockwiseFP8Config | None
) -> tuple[dict, dict | None]:
    """(dtype of every tensor to write, config.json overrides): the source checkpoint's dtypes,
    and with ``fp8`` the FP8 weights and their scales plus the ``quantization_config``.

    Builds the export plan (collective); FP8 problems surface here, on every rank alike, before
    any tensor moves.
    """
    if fp8 is None:
        return dict(source_dtypes), None
    try:
        plan = bridge.export_plan(chunks, fp8=fp8)
    except FP8FormatError as err:
        raise BadInput(f"cannot write an FP8 checkpoint: {err}") from err
    scales = [e for e in plan.entries if e.scale_of is not None]
    changed = {e.hf_name: e.torch_dtype for e in plan.entries if e.scale_of is not None or e.torch_dtype == FP8_DTYPE}
    logger.info("FP8 blockwise: %d of %d tensors quantized", len(scales), len(plan.entries) - len(scales))
    return {**source_dtypes, **changed}, {"quantization_config": bridge.fp8_config(fp8).quantization_config(plan)}
