"""The FP8 export plan: the BF16 plan with each quantized weight followed by its scale.

Checked before any export work (``check_fp8_exportable``): storage formats the blockwise export
cannot ship, trainer-side FP8 shards off block boundaries, tied weights, and (with
``engine_tp_size``) engine shards off block boundaries all raise ``FP8FormatError`` naming the
weight and the fix. A sharded refit, whose engine ranks quantize their own boxes of each weight,
checks those boxes against the block grid (``check_engine_boxes``) with the same refusal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from mbridge_refit.fp8.format import (
    BLOCK,
    FP8_DTYPE_NAME,
    SCALE_DTYPE_NAME,
    BlockwiseFP8Config,
    FP8FormatError,
    scale_name,
    scale_shape,
)
from mbridge_refit.plan.entries import ExportPlan, PlanEntry, TensorSharding
from mbridge_refit.plan.slices import SliceCopy
from mbridge_refit.plan.storage import FP8_BLOCKWISE, QUANTIZABLE

if TYPE_CHECKING:
    from mbridge_refit.plan.transfer import EngineShard, TransferPlan

__all__ = ["check_engine_boxes", "check_fp8_exportable", "fp8_plan", "scale_sharding", "yielded_bytes"]


def fp8_plan(plan: ExportPlan, config: BlockwiseFP8Config) -> ExportPlan:
    """``plan`` as the FP8 export yields it: each quantized weight becomes ``float8_e4m3fn``
    and is followed by its ``weight_scale_inv`` entry (``scale_of`` names the weight).

    The scale of a weight quantized on export is computed from the assembled HF tensor, so its
    entry keeps the weight's source layout. The scale of a weight the trainer already stores
    as blockwise FP8 (``source_format == "fp8_blockwise"``) is shipped from the trainer's
    shards: its layout is the weight's, in block coordinates (``scale_sharding``).
    """
    check_fp8_exportable(plan, config)
    entries: list[PlanEntry] = []
    for entry in plan.entries:
        if not config.quantizes(entry.hf_name, entry.shape, entry.dtype):
            entries.append(entry)
            continue
        native = entry.source_format == FP8_BLOCKWISE
        conversion = entry.elementwise_op or entry.relayout
        if native and conversion is not None:
            raise FP8FormatError(
                f"{entry.hf_name}: its export applies {conversion!r} to the values, which cannot be done on the "
                "trainer's FP8 data and scales; keep this parameter in BF16 (out of TE's FP8 storage)"
            )
        entries.append(dataclasses.replace(entry, dtype=FP8_DTYPE_NAME))
        entries.append(
            dataclasses.replace(
                entry,
                hf_name=scale_name(entry.hf_name),
                shape=scale_shape(entry.shape),
                dtype=SCALE_DTYPE_NAME,
                scale_of=entry.hf_name,
                sharding=scale_sharding(entry) if native else entry.sharding,
            )
        )
    return dataclasses.replace(plan, entries=tuple(entries))


def yielded_bytes(plan: ExportPlan) -> dict[str, int]:
    """Bytes the export of ``plan`` (an ``fp8_plan``) yields for each HF tensor of the BF16 plan
    it was made from: a quantized weight's e4m3 data plus its scales, the others' own bytes. The
    FP8 export sizes its buckets with it (``PlanExporter.export_buckets(bucket_sizes=...)``): a
    bucket holds up to the bucket budget of what it yields (at TP=1, about twice the layers of a
    BF16 bucket; the BF16 sources are views of the parameters there, so the budget is what the
    bucket's buffers take; with tensor parallelism the gathered BF16 tensors behind a bucket
    take about twice its budget again)."""
    sizes: dict[str, int] = {}
    for entry in plan.entries:
        name = entry.scale_of if entry.scale_of is not None else entry.hf_name
        sizes[name] = sizes.get(name, 0) + entry.nbytes
    return sizes


def scale_sharding(entry: PlanEntry) -> TensorSharding:
    """Where the trainer's ``scale_inv`` rows/columns of a natively-FP8 weight sit, per rank.

    TE quantizes each local shard with blocks anchored at the shard's (0, 0). Its scales are the
    HF tensor's scales exactly when every slice of the HF tensor a shard holds starts on a block
    boundary, both in the HF tensor and in the shard, and is a whole number of blocks long (a
    slice may end in a partial block only where both tensors end). Raises ``FP8FormatError``
    otherwise, naming the weight and the slice.
    """
    local_shape = entry.sharding.local_shape
    pieces = tuple(
        tuple(_scale_piece(entry, copy, rank) for copy in rank_pieces)
        for rank, rank_pieces in enumerate(entry.sharding.pieces)
    )
    return dataclasses.replace(entry.sharding, pieces=pieces, local_shape=scale_shape(local_shape))


def _scale_piece(entry: PlanEntry, copy: Any, rank: int) -> Any:
    hf_extent, local_extent = entry.shape[copy.dim], entry.sharding.local_shape[copy.dim]
    whole_blocks = copy.length % BLOCK == 0 or (
        copy.hf_stop == hf_extent and copy.local_start + copy.length == local_extent
    )
    if copy.hf_start % BLOCK or copy.local_start % BLOCK or not whole_blocks:
        what = "rows" if copy.dim == 0 else "columns"
        raise FP8FormatError(
            f"{entry.hf_name} ({entry.megatron_param}, stored as blockwise FP8): tensor-parallel rank {rank} holds "
            f"its {what} [{copy.hf_start}, {copy.hf_stop}) at local {what} [{copy.local_start}, "
            f"{copy.local_start + copy.length}), which is not a run of whole {BLOCK}-element blocks in both tensors, "
            f"so the trainer's per-shard FP8 blocks are not the HF tensor's blocks. Use a layout whose shards of this tensor are multiples of {BLOCK} (e.g. a smaller "
            "tensor-parallel size, or a head_dim / FFN size that is a multiple of 128), or export in BF16."
        )
    return SliceCopy(
        hf_name=scale_name(copy.hf_name),
        dim=copy.dim,
        hf_start=copy.hf_start // BLOCK,
        hf_stop=math.ceil(copy.hf_stop / BLOCK),
        local_start=copy.local_start // BLOCK,
    )


def check_fp8_exportable(plan: ExportPlan, config: BlockwiseFP8Config) -> None:
    """Raise ``FP8FormatError`` before any export work if ``plan`` cannot be exported as FP8."""
    quantized = [e for e in plan.entries if config.quantizes(e.hf_name, e.shape, e.dtype)]
    foreign = sorted({(e.megatron_param, e.source_format) for e in quantized if e.source_format not in QUANTIZABLE})
    if foreign:
        name, storage = foreign[0]
        raise FP8FormatError(
            f"{name} is stored by Transformer Engine as {storage}, which the 128x128 blockwise FP8 export cannot "
            f"ship as is ({len(foreign)} such parameters). Train with the blockwise recipe "
            "(Megatron fp8_recipe='blockwise', TE Float8BlockScaling) to export its FP8 data directly, or export "
            "in BF16 (fp8=None), which dequantizes them."
        )
    for entry in quantized:
        if entry.source_format == FP8_BLOCKWISE:
            scale_sharding(entry)  # raises for shards off block boundaries, before any export work
    if not quantized:
        raise FP8FormatError(
            "no tensor of this model is quantized by the blockwise FP8 export (every 2-D weight matches "
            f"keep_patterns={list(config.keep_patterns)}): narrow keep_patterns or export without fp8"
        )
    aliased = {e.alias_of for e in plan.entries if e.alias_of is not None}
    tied = [e.hf_name for e in quantized if e.hf_name in aliased]
    if tied:
        raise FP8FormatError(
            f"{tied} share data with a tied output weight that stays in its dtype: add them to keep_patterns"
        )
    if config.engine_tp_size is not None:
        problems = [p for e in quantized if (p := _engine_split_problem(e, config.engine_tp_size))]
        _refuse_engine_split(
            f"an engine at tensor-parallel size {config.engine_tp_size}",
            problems,
            "Serve at a smaller tensor-parallel size, keep these weights in bf16 (keep_patterns), or export without fp8.",
        )


def check_engine_boxes(plan: ExportPlan, transfer: "TransferPlan") -> None:
    """Raise ``FP8FormatError`` if an engine rank's box (``transfer``'s shards) of a weight that ``plan``
    (an ``fp8_plan``) quantizes starts off the 128-element block grid, or ends off it before the
    tensor's end, in any dimension. Where every box is on the grid, quantizing a box alone gives the
    whole tensor's FP8 data in that box, and its scales are the whole tensor's in ``scale_box(box)``;
    elsewhere a block would span two engine ranks."""
    shapes = {e.hf_name: e.shape for e in plan.entries}
    quantized = {e.scale_of: shapes[e.scale_of] for e in plan.entries if e.scale_of is not None}
    problems = [p for s in transfer.shards if s.hf_name in quantized and (p := _box_problem(s, quantized[s.hf_name]))]
    _refuse_engine_split(
        f"an engine laid out as {transfer.engine.name}",
        problems,
        "Serve at a smaller tensor-parallel size (each rank's shards whole blocks), refit this engine with full "
        "tensors (VLLMRefit at TP1, or the packed broadcast), or keep these weights in bf16 (keep_patterns) with an "
        "engine checkpoint that keeps them in bf16 too.",
    )


def _box_problem(shard: "EngineShard", shape: tuple[int, ...]) -> str | None:
    for dim, ((start, stop), size) in enumerate(zip(shard.box, shape)):
        if start % BLOCK or (stop % BLOCK and stop != size):
            return (
                f"{shard.hf_name} {tuple(shape)}: engine rank {shard.engine_rank} keeps {[list(b) for b in shard.box]}, "
                f"whose dimension {dim} [{start}, {stop}) is not whole {BLOCK}-element blocks"
            )
    return None


def _refuse_engine_split(engine: str, problems: list[str], fix: str) -> None:
    if problems:
        raise FP8FormatError(
            f"{engine} cannot shard these FP8 weights on {BLOCK}x{BLOCK} block boundaries: {'; '.join(problems[:5])}"
            f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. {fix}"
        )


def _engine_split_problem(entry: PlanEntry, engine_tp: int) -> str | None:
    """Why an engine at ``engine_tp`` cannot shard ``entry`` on block boundaries (None if it can).

    Expert weights and replicated weights are split like dense ones by engines that use
    tensor-parallel MoE, so every quantized weight is checked on its split dimension: rows for
    row-split (column-parallel) weights, columns for column-split (row-parallel) weights.
    """
    split_dim = 1 if entry.kind == "row" else 0
    size = entry.shape[split_dim]
    if size % engine_tp or (size // engine_tp) % BLOCK:
        what = "input" if split_dim else "output"
        return f"{entry.hf_name} {what} size {size} / tp {engine_tp} is not a multiple of {BLOCK}"
    return None
