"""The blockwise FP8 export of one model: what it runs (``FP8Export``) and its stream.

``build_fp8_export`` derives an ``FP8Export`` from the BF16 plan and its exporter: the FP8 plan
(``fp8.plan``), the exporter of the weights (the BF16 one, or one reading the e4m3 data of
weights the trainer keeps as blockwise FP8) and the exporter of those weights' ``scale_inv``
shards. ``fp8_buckets`` runs it: the weights' buckets, LoRA adapters merged into them
(``runtime.lora``), quantized (``fp8.quantize``), the trainer's scales put after their weights,
narrowed to ``only``. ``RefitBridge`` keeps one ``FP8Export`` per model and config and is the
facade callers use (``fp8_export``, ``export_hf_weights(fp8=...)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from mbridge_refit.fp8 import te as te_fp8
from mbridge_refit.fp8.format import FP8_DTYPE_NAME, BlockwiseFP8Config, FP8FormatError, scale_name
from mbridge_refit.fp8.plan import fp8_plan, yielded_bytes
from mbridge_refit.fp8.quantize import quantize_bucket_lists
from mbridge_refit.plan.entries import ExportPlan, PlanError
from mbridge_refit.plan.storage import FP8_BLOCKWISE
from mbridge_refit.runtime.buffers import ExportBuffers
from mbridge_refit.runtime.exporter import PlanExporter
from mbridge_refit.runtime.lora import AdapterExport

__all__ = ["FP8Export", "build_fp8_export", "fp8_adapters", "fp8_buckets", "resolve_fp8_config"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FP8Export:
    """What an FP8 export of one model with one config runs (built once by ``RefitBridge.fp8_export``)."""

    base: ExportPlan  # the BF16 plan it was derived from
    config: BlockwiseFP8Config
    plan: ExportPlan  # what the export yields
    weights: PlanExporter
    scales: PlanExporter | None  # scale_inv shards of the weights the trainer keeps as FP8
    shipped_scales: frozenset[str]  # HF names of those weights
    bucket_sizes: dict[str, int]  # bytes yielded per BF16-plan tensor: buckets hold what the FP8 export yields
    _needed: dict = field(default_factory=dict, repr=False, compare=False)  # _selection's, per ``only``

    def scale_names(self) -> dict[str, str]:
        """HF name of each weight the export quantizes or ships as FP8 -> the HF name of its ``weight_scale_inv``."""
        return {e.scale_of: e.hf_name for e in self.plan.entries if e.scale_of is not None}

    def weights_needed(self, only: frozenset[str]) -> frozenset[str]:
        """The BF16-plan names an export of ``only`` reads: the selected weights and the weights whose
        scales are selected."""
        return self._selection(only)[0]

    def yields_only(self, only: frozenset[str]) -> bool:
        """Whether reading ``weights_needed(only)`` yields names of ``only`` alone (each weight read
        and its scale both selected), so that nothing is left to filter out."""
        return self._selection(only)[1]

    def _selection(self, only: frozenset[str]) -> tuple[frozenset[str], bool]:
        """Kept per set of names: a few sets, the same every step of a refit."""
        selection = self._needed.get(only)
        if selection is None:
            if len(self._needed) >= 8:
                self._needed.clear()
            needed = frozenset(e.scale_of or e.hf_name for e in self.plan.entries if e.hf_name in only)
            yielded = {e.hf_name for e in self.plan.entries if e.hf_name in needed or e.scale_of in needed}
            selection = self._needed[only] = (needed, yielded <= only)
        return selection


def resolve_fp8_config(fp8: BlockwiseFP8Config | str | None, architecture: str | None) -> BlockwiseFP8Config | None:
    """The config an export with ``fp8=fp8`` runs for a model of ``architecture`` (the HF config's
    ``architectures[0]``): ``"blockwise"`` or a ``BlockwiseFP8Config`` without ``keep_patterns``
    gets the keep patterns of that family (``fp8.keep``); explicit ``keep_patterns`` are kept as
    given. Raises ``FP8FormatError`` for anything else."""
    if fp8 is None:
        return None
    if fp8 == "blockwise":
        fp8 = BlockwiseFP8Config()
    if not isinstance(fp8, BlockwiseFP8Config):
        raise FP8FormatError(f"fp8={fp8!r} is not a known FP8 format: use 'blockwise' or a BlockwiseFP8Config")
    return fp8.for_architecture(architecture)


def build_fp8_export(
    base: ExportPlan, config: BlockwiseFP8Config, bf16_exporter: PlanExporter, params: dict[str, torch.Tensor]
) -> FP8Export:
    """The ``FP8Export`` of the BF16 plan ``base`` with ``config``, over this rank's ``params``: the
    weights read by ``bf16_exporter``, or, where the trainer keeps weights as blockwise FP8, by an
    exporter of their e4m3 data with one of their ``scale_inv`` shards beside it."""
    plan = fp8_plan(base, config)
    native_scales = tuple(e for e in plan.entries if e.scale_of is not None and e.source_format == FP8_BLOCKWISE)
    native_weights = frozenset(e.scale_of for e in native_scales)
    weights, scales = bf16_exporter, None
    if native_scales:
        weights_plan = dataclasses.replace(
            base,
            entries=tuple(
                dataclasses.replace(e, dtype=FP8_DTYPE_NAME) if e.hf_name in native_weights else e for e in base.entries
            ),
        )
        weights = PlanExporter(
            plan=weights_plan, params=params, device=bf16_exporter.device, shards=te_fp8.fp8_data_shards(params)
        )
        scales = PlanExporter(
            plan=dataclasses.replace(plan, entries=native_scales),
            params=params,
            device=bf16_exporter.device,
            shards=te_fp8.fp8_scale_shards(params),
        )
    return FP8Export(
        base=base,
        config=config,
        plan=plan,
        weights=weights,
        scales=scales,
        shipped_scales=native_weights,
        bucket_sizes=yielded_bytes(plan),
    )


def fp8_adapters(adapters: Callable[[], AdapterExport | None], fp8: FP8Export) -> AdapterExport | None:
    """The adapters an FP8 export merges before quantizing (``adapters()``, the model's LoRA adapter
    export; None: the model has none); raises ``FP8FormatError`` where they cannot be merged (the
    FP8 export has no stock path)."""
    try:
        lora = adapters()
    except PlanError as err:
        raise FP8FormatError(f"the FP8 export merges LoRA adapters from their plan, which fails: {err}") from err
    if lora is not None and fp8.scales is not None:
        raise FP8FormatError(
            "the trainer keeps FP8 weights that LoRA adapters wrap: merging needs the high-precision weights"
        )
    return lora


def fp8_buckets(
    fp8: FP8Export,
    lora: AdapterExport | None,
    buffers: ExportBuffers,
    *,
    show_progress: bool,
    only: frozenset[str] | None,
    in_buckets: bool,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The FP8 export, in lists (one per BF16-plan bucket, or one per tensor unless
    ``in_buckets``): weights the trainer keeps as blockwise FP8 are shipped as they are, with
    their scales; high-precision weights are quantized bucket by bucket into (cached) buffers.
    With ``only``, the selected weights (and the weights whose scales are selected) are
    exported; with trainer scales, whose stream follows the whole plan, everything is.
    ``lora``'s adapters are merged into their weights before those are quantized."""
    needed = fp8.weights_needed(only) if only is not None and fp8.scales is None else None
    buckets = fp8.weights.export_buckets(
        buffers,
        show_progress=show_progress,
        select_rows_lazily=lora is None,
        bucket_sizes=fp8.bucket_sizes,
        needed=needed,
    )
    if lora is not None:
        buckets = lora.merged(buckets, buffers)
    buckets = quantize_bucket_lists(buckets, fp8.plan, buffers)
    if fp8.scales is not None:
        buckets = _with_trainer_scales(buckets, fp8.scales.export(buffers), fp8.shipped_scales, in_buckets=in_buckets)
    if only is not None and (fp8.scales is not None or not fp8.yields_only(only)):
        buckets = ([(name, tensor) for name, tensor in bucket if name in only] for bucket in buckets)
    return buckets


def _with_trainer_scales(
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    scales: Iterable[tuple[str, torch.Tensor]],
    has_scale: frozenset[str],
    *,
    in_buckets: bool,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Put the trainer-side scale stream after each weight named in ``has_scale``.

    Both streams are collective; every rank advances them at the same points (the plan's), so
    their gathers and pipeline broadcasts are issued in the same order everywhere. The scale
    stream reuses its buffers as it advances, so a scale is valid only until the next one is
    read: ``in_buckets`` copies each (scales are 1/16384 of their weights' elements) so that a
    bucket's tensors stay valid together; otherwise one list per tensor, read before the next.
    """
    scales = iter(scales)
    for bucket in buckets:
        merged = []
        for name, tensor in bucket:
            if not in_buckets:
                yield [(name, tensor)]
            else:
                merged.append((name, tensor))
            if name in has_scale:
                expected_name, scale = next(scales)
                assert expected_name == scale_name(name), (expected_name, name)
                if in_buckets:
                    merged.append((expected_name, scale.clone()))
                else:
                    yield [(expected_name, scale)]
        if in_buckets:
            yield merged
