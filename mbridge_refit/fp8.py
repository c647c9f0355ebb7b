"""The blockwise FP8 weight format (DeepSeek-V3 style) and the BF16 -> FP8 export transform.

An HF FP8 checkpoint stores each quantized linear weight ``W`` [rows, cols] as

* ``<module>.weight``: ``float8_e4m3fn``, same shape as ``W``;
* ``<module>.weight_scale_inv``: ``float32`` [ceil(rows/128), ceil(cols/128)], one scale per
  128x128 block, such that ``W ~= weight.float() * weight_scale_inv`` (block-broadcast).

Choices, all in this module:

* **Block grid.** Blocks are anchored at (0, 0) of the *HF* tensor. A shape not divisible by
  128 has partial edge blocks; their scale covers only the elements that exist (no padding
  values enter the amax). Blocks are defined on the HF tensor, never on a Megatron shard: a
  tensor-parallel shard of q/k/v or gate/up does not start on a block boundary in general, so
  quantization runs after the export has assembled the HF tensor (on the device, in cached
  buffers), or, for q/k/v selected from the fused QKV without tensor parallelism, on the
  selection's row runs in place when each run is whole block rows of the HF tensor (the same
  blocks; ``quantize_buckets``).
* **Scale.** ``scale_inv = amax(|block|) / 448`` in fp32 (448 = the largest e4m3fn value), so the
  block's largest element maps to +-448. ``amax`` is exact (a max of bf16 values widened to
  fp32); the division is IEEE round-to-nearest (never a multiply by a reciprocal: PyTorch's CUDA
  division by a Python scalar does that, so the torch path divides by a device tensor).
* **All-zero block.** ``scale_inv = 1.0`` (any value dequantizes zeros to zero; 1.0 keeps the
  scale finite and the tensor free of 0/0).
* **Quantization.** ``q = e4m3fn(clamp(x_fp32 / scale_inv, -448, 448))``: an IEEE fp32 division,
  a clamp (``|x| / scale_inv`` can exceed 448 by one ulp), and round-to-nearest-even into e4m3fn.
  The division (not a multiply by ``448 / amax``) is what makes CPU, CUDA and the Triton kernel
  agree bit for bit. NaN or inf in a block make that block's scale NaN/inf (not checked: it
  would cost a device sync per tensor).
* **What is quantized.** 2-D ``*.weight`` tensors of linear layers; names matching
  ``BlockwiseFP8Config.keep_patterns`` (embeddings, output layer, norms, MoE routers by default)
  stay in their dtype and are listed in the config's ``modules_to_not_convert``.

``quantize_blockwise`` is the reference implementation in torch ops (CPU and GPU); on CUDA
one-pass Triton kernels (``fp8_kernels``: one program per block: load once, amax, scale, store;
the quotient by one reciprocal per block and two FMAs, which is the IEEE quotient) produce the
same bits.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

if TYPE_CHECKING:
    from mbridge_refit.export import ExportBuffers, RowSelection
    from mbridge_refit.plan import ExportPlan, PlanEntry, SourceLayout

logger = logging.getLogger(__name__)

BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv
FP8_DTYPE_NAME = str(FP8_DTYPE).removeprefix("torch.")  # as plan entries name dtypes
SCALE_DTYPE_NAME = str(SCALE_DTYPE).removeprefix("torch.")
# How the trainer stores a weight (``PlanEntry.source_format``; te_fp8 tells them apart):
PLAIN_SOURCE = "plain"  # a high-precision tensor: quantized on export
FP8_BLOCKWISE_SOURCE = "fp8_blockwise"  # TE 128x128 blockwise e4m3: shipped as stored
QUANTIZABLE_SOURCES = (PLAIN_SOURCE, FP8_BLOCKWISE_SOURCE)

DEFAULT_KEEP_PATTERNS = (
    "*embed_tokens.weight",
    "lm_head.weight",
    "*norm.weight",
    "*.mlp.gate.weight",  # MoE router
)


class FP8FormatError(ValueError):
    """A model or option that cannot be exported as blockwise FP8 (the message says why and what to do)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockwiseFP8Config:
    """What to quantize and how an engine will shard it.

    Args:
        keep_patterns: ``fnmatch`` patterns of HF names that stay in their source dtype.
        engine_tp_size: if set, check that an inference engine running at this tensor-parallel
            size can shard every quantized weight on block boundaries (vLLM requires each
            output partition of q/k/v, gate/up and column-parallel weights, and each input
            partition of row-parallel weights, to be a multiple of 128).
    """

    keep_patterns: tuple[str, ...] = DEFAULT_KEEP_PATTERNS
    engine_tp_size: int | None = None

    def quantizes(self, hf_name: str, shape: tuple[int, ...], dtype: str) -> bool:
        """Whether the export turns this HF tensor into FP8 data + scales."""
        return (
            len(shape) == 2
            and hf_name.endswith(".weight")
            and getattr(torch, dtype).is_floating_point
            and not any(fnmatch.fnmatchcase(hf_name, p) for p in self.keep_patterns)
        )

    def quantization_config(self, plan: "ExportPlan") -> dict[str, Any]:
        """The ``quantization_config`` entry of an HF FP8 ``config.json`` for ``plan``."""
        kept = sorted(
            e.hf_name[: -len(".weight")]
            for e in plan.entries
            if len(e.shape) == 2 and e.hf_name.endswith(".weight") and not self.quantizes(e.hf_name, e.shape, e.dtype)
        )
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": kept,
        }


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))


def scale_name(hf_name: str) -> str:
    return hf_name + SCALE_SUFFIX


# --- the plan ----------------------------------------------------------------------------------


def fp8_plan(plan: "ExportPlan", config: BlockwiseFP8Config) -> "ExportPlan":
    """``plan`` as the FP8 export yields it: each quantized weight becomes ``float8_e4m3fn``
    and is followed by its ``weight_scale_inv`` entry (``scale_of`` names the weight).

    The scale of a weight quantized on export is computed from the assembled HF tensor, so its
    entry keeps the weight's source layout. The scale of a weight the trainer already stores
    as blockwise FP8 (``source_format == "fp8_blockwise"``) is shipped from the trainer's
    shards: its layout is the weight's, in block coordinates (``scale_layout``).
    """
    check_fp8_exportable(plan, config)
    entries: list[PlanEntry] = []
    for entry in plan.entries:
        if not config.quantizes(entry.hf_name, entry.shape, entry.dtype):
            entries.append(entry)
            continue
        native = entry.source_format == FP8_BLOCKWISE_SOURCE
        entries.append(dataclasses.replace(entry, dtype=FP8_DTYPE_NAME))
        entries.append(
            dataclasses.replace(
                entry,
                hf_name=scale_name(entry.hf_name),
                shape=scale_shape(entry.shape),
                dtype=SCALE_DTYPE_NAME,
                scale_of=entry.hf_name,
                layout=scale_layout(entry) if native else entry.layout,
            )
        )
    return dataclasses.replace(plan, entries=tuple(entries))


def yielded_bytes(plan: "ExportPlan") -> dict[str, int]:
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


def scale_layout(entry: "PlanEntry") -> "SourceLayout":
    """Where the trainer's ``scale_inv`` rows/columns of a natively-FP8 weight sit, per rank.

    TE quantizes each local shard with blocks anchored at the shard's (0, 0). Its scales are the
    HF tensor's scales exactly when every slice of the HF tensor a shard holds starts on a block
    boundary, both in the HF tensor and in the shard, and is a whole number of blocks long (a
    slice may end in a partial block only where both tensors end). Raises ``FP8FormatError``
    otherwise, naming the weight and the slice.
    """
    local_shape = entry.layout.local_shape
    pieces = tuple(tuple(_scale_piece(entry, copy, rank) for copy in rank_pieces) for rank, rank_pieces in enumerate(entry.layout.pieces))
    return dataclasses.replace(entry.layout, pieces=pieces, local_shape=scale_shape(local_shape))


def _scale_piece(entry: "PlanEntry", copy: Any, rank: int) -> Any:
    from mbridge_refit.placement import SliceCopy

    hf_extent, local_extent = entry.shape[copy.dim], entry.layout.local_shape[copy.dim]
    whole_blocks = copy.length % BLOCK == 0 or (copy.hf_stop == hf_extent and copy.local_start + copy.length == local_extent)
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


def check_fp8_exportable(plan: "ExportPlan", config: BlockwiseFP8Config) -> None:
    """Raise ``FP8FormatError`` before any export work if ``plan`` cannot be exported as FP8."""
    quantized = [e for e in plan.entries if config.quantizes(e.hf_name, e.shape, e.dtype)]
    foreign = sorted({(e.megatron_param, e.source_format) for e in quantized if e.source_format not in QUANTIZABLE_SOURCES})
    if foreign:
        name, storage = foreign[0]
        raise FP8FormatError(
            f"{name} is stored by Transformer Engine as {storage}, which the 128x128 blockwise FP8 export cannot "
            f"ship as is ({len(foreign)} such parameters). Train with the blockwise recipe "
            "(Megatron fp8_recipe='blockwise', TE Float8BlockScaling) to export its FP8 data directly, or export "
            "in BF16 (fp8=None), which dequantizes them."
        )
    for entry in quantized:
        if entry.source_format == FP8_BLOCKWISE_SOURCE:
            scale_layout(entry)  # raises for shards off block boundaries, before any export work
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
        if problems:
            raise FP8FormatError(
                f"an engine at tensor-parallel size {config.engine_tp_size} cannot shard these FP8 weights on "
                f"{BLOCK}x{BLOCK} block boundaries: {'; '.join(problems[:5])}"
                f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. "
                "Serve at a smaller tensor-parallel size, keep these weights in bf16 (keep_patterns), "
                "or export without fp8."
            )


def _engine_split_problem(entry: "PlanEntry", engine_tp: int) -> str | None:
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


# --- quantization ------------------------------------------------------------------------------


def quantize_blockwise(
    x: torch.Tensor, *, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None, work: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to (e4m3fn data, fp32 ``scale_inv``) as the module docstring says.

    ``out`` [rows, cols] float8_e4m3fn, ``scale_out`` ``scale_shape(x.shape)`` float32 and, for
    the torch path, ``work`` (fp32, ``padded_shape(x.shape)``) are written in place when given
    (cached buffers); otherwise allocated. On CUDA with Triton the work buffer is not used.
    """
    if x.dim() != 2:
        raise FP8FormatError(f"blockwise FP8 needs a 2-D tensor, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
    scale_out = torch.empty(scale_shape(tuple(x.shape)), dtype=SCALE_DTYPE, device=x.device) if scale_out is None else scale_out
    if x.is_cuda and _kernel_usable("single"):
        _cuda_kernels().quantize_single(x, out, scale_out)
        return out, scale_out
    work = torch.empty(padded_shape(tuple(x.shape)), dtype=torch.float32, device=x.device) if work is None else work
    _quantize_torch(x, out, scale_out, work)
    return out, scale_out


def padded_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = scale_shape(shape)
    return (rows * BLOCK, cols * BLOCK)


def _quantize_torch(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, work: torch.Tensor) -> None:
    rows, cols = x.shape
    block_rows, block_cols = scale_out.shape
    padded = work.view(block_rows * BLOCK, block_cols * BLOCK)
    if (rows, cols) != padded.shape:
        padded.zero_()  # zeros never raise a block's amax
    region = padded[:rows, :cols]
    region.copy_(x)
    blocks = padded.view(block_rows, BLOCK, block_cols, BLOCK)
    torch.linalg.vector_norm(blocks, ord=math.inf, dim=(1, 3), out=scale_out)
    scale_out.div_(_e4m3_max_on(scale_out.device))  # a tensor, not a Python scalar: see _e4m3_max_on
    scale_out.masked_fill_(scale_out == 0, 1.0)
    blocks.div_(scale_out.view(block_rows, 1, block_cols, 1)).clamp_(-E4M3_MAX, E4M3_MAX)
    out.copy_(region)


_E4M3_MAX_TENSORS: dict[str, torch.Tensor] = {}


def _e4m3_max_on(device: torch.device) -> torch.Tensor:
    """448 as a 0-dim fp32 tensor on ``device``, made once per device.

    Dividing by it is an IEEE division everywhere; dividing a CUDA tensor by a Python scalar is
    not (PyTorch multiplies by the scalar's reciprocal there, which can differ by one ulp).
    """
    key = str(device)
    if key not in _E4M3_MAX_TENSORS:
        _E4M3_MAX_TENSORS[key] = torch.full((), E4M3_MAX, dtype=torch.float32, device=device)
    return _E4M3_MAX_TENSORS[key]


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale_inv`` with the scale broadcast over its block (for checks and tests)."""
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * expanded


# --- the export transform ----------------------------------------------------------------------


def quantize_buckets(
    buckets: Iterable[list[tuple[str, "torch.Tensor | RowSelection"]]], plan: "ExportPlan", buffers: "ExportBuffers"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a bucketed BF16 export (``PlanExporter.export_buckets``, rows selected lazily or not)
    into the FP8 stream that ``plan`` (an ``fp8_plan``) describes.

    Each quantized weight is yielded as its e4m3fn data, then its ``weight_scale_inv``; tensors
    already in FP8 (shipped with their own scales) and tensors kept in their dtype pass through.
    A bucket's weights are quantized together (on CUDA: one grouped kernel launch per bucket and
    input dtype) into ``buffers`` keyed by position in the bucket, so the outputs stay valid
    until the generator moves past the bucket (reused across exports when the pool is
    persistent; how each bucket is quantized is then decided once and kept in ``buffers.memo``).
    A ``RowSelection`` whose runs start on block rows (and are whole blocks, but for the
    tensor's last) is quantized run by run from its source: the same blocks, no copy.
    """
    scales = {e.scale_of: e for e in plan.entries if e.scale_of is not None}
    for bucket in buckets:
        names = tuple(name for name, _ in bucket)
        quantizer = buffers.memo.get(("fp8", names))
        if quantizer is None:
            quantizer = buffers.memo[("fp8", names)] = _BucketQuantizer.build(bucket, scales, buffers)
        quantizer.run([bucket[i][1] for i in quantizer.positions], buffers)
        for position, (name, tensor) in enumerate(bucket):
            job = quantizer.job_at.get(position)
            if job is None:
                yield name, _materialized(tensor)
            else:
                yield name, quantizer.q[job]
                yield quantizer.scale_names[job], quantizer.scales[job]


def row_piece(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, x_row: int, q_row: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` rows of the quantized tensor ``q`` from ``q_row`` (a block row) and their scales,
    read from ``x`` at ``x_row``: a ``(source, q, scale)`` job of its own whose blocks are the
    tensor's (views; a run of q/k/v in the fused QKV, or a chunk of a grouped launch)."""
    return x.narrow(0, x_row, rows), q.narrow(0, q_row, rows), scale.narrow(0, q_row // BLOCK, math.ceil(rows / BLOCK))


def _materialized(tensor: "torch.Tensor | RowSelection") -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


def _block_runs(selection: "RowSelection") -> tuple[tuple[int, int, int], ...] | None:
    """The selection's runs if each is a run of whole block rows of the HF tensor (the last may
    end the tensor in a partial block), so that quantizing run by run gives the tensor's blocks."""
    rows = selection.shape[0]
    aligned = all(hf % BLOCK == 0 and (length % BLOCK == 0 or hf + length == rows) for hf, _, length in selection.runs)
    return selection.runs if aligned else None


@dataclass(kw_only=True, slots=True)
class _BucketQuantizer:
    """How one export bucket is quantized: which of its tensors, into which buffers, with which
    launches. Built on the bucket's first export; the launches are re-planned only when the
    sources' addresses or strides change (a persistent export's sources keep theirs)."""

    positions: tuple[int, ...]  # positions in the bucket of the weights to quantize
    job_at: dict[int, int]  # position in the bucket -> index into the tuples below
    scale_names: tuple[str, ...]
    q: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    runs: tuple  # per weight: row runs to quantize from a RowSelection's source, or None
    _sources_key: tuple = ()
    _grouped: list = dataclasses.field(default_factory=list)  # fp8_kernels.GroupedLaunch, one per input dtype
    _singles: tuple[int, ...] = ()  # jobs (see _jobs) quantized one launch each (unaligned, or no grouped kernel)

    @classmethod
    def build(cls, bucket: list[tuple[str, Any]], scales: dict, buffers: "ExportBuffers") -> "_BucketQuantizer":
        from mbridge_refit.export import RowSelection  # export -> plan -> te_fp8 -> fp8

        positions, scale_names, q, s, runs = [], [], [], [], []
        for position, (name, tensor) in enumerate(bucket):
            entry = scales.get(name)
            if entry is None or tensor.dtype == FP8_DTYPE:  # FP8 already: shipped with its own scale
                continue
            index = len(positions)
            positions.append(position)
            scale_names.append(entry.hf_name)
            q.append(buffers.get("fp8", index, tuple(tensor.shape), FP8_DTYPE, tensor.device))
            s.append(buffers.get("fp8_scale", index, entry.shape, SCALE_DTYPE, tensor.device))
            runs.append(_block_runs(tensor) if isinstance(tensor, RowSelection) else None)
        return cls(
            positions=tuple(positions), job_at={p: i for i, p in enumerate(positions)}, scale_names=tuple(scale_names),
            q=tuple(q), scales=tuple(s), runs=tuple(runs),
        )

    def run(self, sources: list, buffers: "ExportBuffers") -> None:
        """Quantize this export's ``sources`` (the bucket's tensors at ``positions``)."""
        sources = self._resolved(sources)
        key = tuple((x.data_ptr(), x.stride(0) if x.dim() else 0) for x in sources)
        if key != self._sources_key:
            self._plan_launches(sources)
            self._sources_key = key
        for launch in self._grouped:
            _cuda_kernels().launch_grouped(launch)
        jobs = list(self._jobs(sources)) if self._singles else []  # views of this export's sources
        for source, q, scale in (jobs[i] for i in self._singles):
            work = None
            if not (source.is_cuda and _kernel_usable("single")):
                work = buffers.get("fp8_work", 0, padded_shape(tuple(source.shape)), torch.float32, source.device)
            quantize_blockwise(source, out=q, scale_out=scale, work=work)

    def jobs(self, sources: list) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The ``(source, q, scale)`` jobs ``run`` quantizes for these sources (for benchmarks)."""
        return list(self._jobs(self._resolved(sources)))

    def _resolved(self, sources: list) -> list[torch.Tensor]:
        """What is read: a selection's source where it is quantized by runs, else a tensor (the
        bucket's items at ``positions`` have the kinds they had when this was built)."""
        return [x.source if runs is not None else _materialized(x) for x, runs in zip(sources, self.runs)]

    def _jobs(self, sources: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(source, q, scale)`` triples: one per weight, or one per row run of a selection."""
        for source, q, scale, runs in zip(sources, self.q, self.scales, self.runs):
            if runs is None:
                yield source, q, scale
            else:
                yield from (row_piece(source, q, scale, x_row=x_row, q_row=q_row, rows=rows) for q_row, x_row, rows in runs)

    def _plan_launches(self, sources: list[torch.Tensor]) -> None:
        kernels = _cuda_kernels() if _kernel_usable("grouped") else None
        by_dtype: dict[torch.dtype, list] = {}
        singles = []
        for i, job in enumerate(self._jobs(sources)):
            if kernels is not None and kernels.grouped_takes(job[0]):
                by_dtype.setdefault(job[0].dtype, []).append(job)
            else:
                singles.append(i)
        # Kept: job numbers and launch tables of raw pointers, no tensors (the pool outlives an
        # export; holding views would keep a trainer's offloaded parameters alive).
        self._singles = tuple(singles)
        self._grouped = [kernels.grouped_launch(jobs) for jobs in by_dtype.values()]


# --- CUDA kernels -------------------------------------------------------------------------------


@functools.cache
def _cuda_kernels():
    """The ``fp8_kernels`` module, or None where Triton is not installed (then the torch path runs)."""
    try:
        from mbridge_refit import fp8_kernels
    except ImportError:
        return None
    return fp8_kernels


def _kernel_usable(kind: str) -> bool:
    kernels = _cuda_kernels()
    return kernels is not None and kernels.usable(kind)


def quantizer_path() -> str:
    """``"triton-grouped"``, ``"triton"`` or ``"torch"``: what the FP8 export uses for CUDA tensors here."""
    if not torch.cuda.is_available():
        return "torch"
    return "triton-grouped" if _kernel_usable("grouped") else "triton" if _kernel_usable("single") else "torch"
