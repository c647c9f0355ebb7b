"""``RefitBridge``: Megatron-Bridge's ``AutoBridge``, extended for per-step weight refit.

Drop-in: ``RefitBridge.from_hf_pretrained`` / ``from_hf_config`` return a ``RefitBridge`` and
every stock method keeps its signature. What changes:

* One ``MegatronModelBridge`` for the bridge's lifetime. Stock ``AutoBridge._model_bridge``
  builds a new one on every access, so per-mapping caches (object broadcasts, detected
  parallelism types, gathered parameter names) are lost between calls.
* ``export_plan(model)``: every HF tensor the export yields, in order, with shapes, dtypes,
  owning stage and source layout — built once from metadata, cached per model.
* ``export_hf_weights(..., reuse_buffer_from_cache=...)`` runs that plan (``export.PlanExporter``):
  views where the HF tensor is a slice of the local shard, one gather per parameter, and, with the
  cache on, output buffers owned by the bridge and reused on every call. Models the plan cannot
  describe (adapters, fused-expert checkpoints, ...) fall back to the stock export, with a warning.
* ``load_hf_shards``: HF → Megatron where each rank reads only its own slices from the
  safetensors files (works on CPU at any TP/PP/EP; the stock loader needs CUDA at TP>1).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from megatron.bridge import AutoBridge

from mbridge_refit.checkpoint import HFCheckpoint
from mbridge_refit import te_fp8
from mbridge_refit.export import ExportBuffers, PlanExporter
from mbridge_refit.fp8 import FP8_DTYPE_NAME, BlockwiseFP8Config, FP8FormatError, fp8_plan, quantize_buckets, yielded_bytes
from mbridge_refit.fp8 import scale_name as fp8_scale_name
from mbridge_refit.loader import LoadReport, load_hf_shards
from mbridge_refit.plan import ExportPlan, PlanError, build_export_plan

logger = logging.getLogger(__name__)


class RefitBridge(AutoBridge):
    """An ``AutoBridge`` that keeps its model bridge and exports for refit.

    Example:
        >>> bridge = RefitBridge.from_hf_pretrained("/path/to/Qwen3-8B")
        >>> for name, tensor in bridge.export_hf_weights(model, reuse_buffer_from_cache=True):
        ...     engine.load_weight(name, tensor)
    """

    @property
    def _model_bridge(self):
        cached = self.__dict__.get("_refit_model_bridge")
        if cached is None:
            cached = super()._model_bridge
            self.__dict__["_refit_model_bridge"] = cached
        cached.export_weight_dtype = self.export_weight_dtype
        return cached

    def _model_bridge_for(self, model: list[torch.nn.Module]):
        """The cached model bridge; per-model caches are dropped when ``model`` is a different model."""
        model_bridge = self._model_bridge
        key = tuple(id(chunk) for chunk in model)
        if self.__dict__.get("_refit_model_key") != key:
            model_bridge.__dict__.pop("_cached_param_names", None)
            self.__dict__["_refit_model_key"] = key
            for cache in ("_refit_plan", "_refit_exporter", "_refit_plan_error", "_refit_fp8"):
                self.__dict__[cache] = None
        return model_bridge

    def export_plan(
        self, model: list[torch.nn.Module] | torch.nn.Module, *, group=None, fp8: BlockwiseFP8Config | str | None = None
    ) -> ExportPlan:
        """The plan of ``export_hf_weights(model, fp8=fp8)``: one entry per yielded HF tensor, in order.

        Collective on the first call for a model, over ``group`` (default: every rank of the job;
        pass the trainer ranks' group when other processes share the job); cached afterwards.
        Moves no tensor data and allocates no weight memory (works on meta-device models).
        Raises ``PlanError`` naming the parameter the plan cannot describe, and with ``fp8``,
        ``FP8FormatError`` when the model cannot be exported as blockwise FP8.
        """
        chunks = model if isinstance(model, list) else [model]
        plan = self._planned(chunks, group)[0]
        config = _fp8_config(fp8)
        return plan if config is None else self._fp8_export(chunks, config).plan

    def _planned(self, chunks: list[torch.nn.Module], group=None) -> tuple[ExportPlan, list]:
        """(plan, conversion tasks) for ``chunks``, built once per model."""
        model_bridge = self._model_bridge_for(chunks)
        planned = self.__dict__.get("_refit_plan")
        if planned is None:
            from megatron.core.utils import unwrap_model

            unwrapped = unwrap_model(chunks)
            tasks = model_bridge.build_conversion_tasks(self.hf_pretrained, unwrapped)
            planned = (build_export_plan(model_bridge, self.hf_pretrained, unwrapped, tasks=tasks, group=group), tasks)
            self.__dict__["_refit_plan"] = planned
        return planned

    def _exporter(self, chunks: list[torch.nn.Module]) -> PlanExporter:
        plan, tasks = self._planned(chunks)
        exporter = self.__dict__.get("_refit_exporter")
        if exporter is None:
            params = _local_params(tasks)
            shards = te_fp8.dequantized_shards(params) if te_fp8.has_quantized_params(params) else None
            exporter = PlanExporter(plan=plan, params=params, device=_device_of(params), shards=shards)
            self.__dict__["_refit_exporter"] = exporter
        return exporter

    def _fp8_export(self, chunks: list[torch.nn.Module], config: BlockwiseFP8Config) -> "_FP8Export":
        """The FP8 plan for ``config`` and the exporters that run it; built once per model and config.

        Weights: the BF16 plan where weights the trainer keeps as blockwise FP8 are read as their
        e4m3 data (the BF16 exporter itself when there are none). Scales: those weights'
        ``scale_inv`` shards (None when the model has none).
        """
        cached = self.__dict__.get("_refit_fp8")
        base, tasks = self._planned(chunks)
        if cached is not None and cached.base is base and cached.config == config:
            return cached
        plan = fp8_plan(base, config)
        native_scales = tuple(e for e in plan.entries if e.scale_of is not None and e.source_format == te_fp8.FP8_BLOCKWISE)
        native_weights = frozenset(e.scale_of for e in native_scales)
        weights, scales = self._exporter(chunks), None
        if native_scales:
            params = _local_params(tasks)
            weights_plan = dataclasses.replace(
                base, entries=tuple(dataclasses.replace(e, dtype=FP8_DTYPE_NAME) if e.hf_name in native_weights else e for e in base.entries)
            )
            weights = PlanExporter(plan=weights_plan, params=params, device=weights.device, shards=te_fp8.fp8_data_shards(params))
            scales = PlanExporter(
                plan=dataclasses.replace(plan, entries=native_scales), params=params, device=weights.device,
                shards=te_fp8.fp8_scale_shards(params),
            )
        cached = _FP8Export(
            base=base, config=config, plan=plan, weights=weights, scales=scales, shipped_scales=native_weights,
            bucket_sizes=yielded_bytes(plan),
        )
        self.__dict__["_refit_fp8"] = cached
        return cached

    def _export_buffers(self) -> ExportBuffers:
        buffers = self.__dict__.get("_refit_buffers")
        if buffers is None:
            buffers = self.__dict__["_refit_buffers"] = ExportBuffers(persistent=True)
        return buffers

    def release_export_buffers(self) -> None:
        """Free the buffers kept by ``export_hf_weights(..., reuse_buffer_from_cache=True)``."""
        buffers = self.__dict__.pop("_refit_buffers", None)
        if buffers is not None:
            buffers.release()

    def export_hf_weights(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        cpu: bool = False,
        show_progress: bool = True,
        conversion_tasks: Optional[list] = None,
        merge_adapter_weights: bool = True,
        weight_dtype: Optional[torch.dtype] = None,
        *,
        reuse_buffer_from_cache: bool = False,
        fp8: BlockwiseFP8Config | str | None = None,
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every HF weight of ``model``, in the bridge's order.

        Collective: every rank of the model's process groups must iterate the generator to the
        end, in step (each yielded tensor may need a gather or pipeline broadcast). Every rank
        receives the full HF tensors. The stock positional arguments are unchanged.

        Args:
            model: the Megatron model chunks (one per virtual pipeline stage), wrapped or not.
            cpu: move each tensor to CPU before yielding it.
            show_progress: progress bar on rank 0.
            conversion_tasks: prebuilt tasks (``get_conversion_tasks``); built if None.
            reuse_buffer_from_cache: write outputs into buffers owned by this bridge, allocated on
                the first call and reused by every later call (steady-state exports allocate
                nothing). Free them with ``release_export_buffers()``.
            fp8: ``"blockwise"`` (or a ``BlockwiseFP8Config``) quantizes BF16/FP32 linear weights on
                export to 128x128-blockwise e4m3fn, each followed by its fp32 ``weight_scale_inv``
                (``export_plan(model, fp8=...)`` lists them). Checked before any export work:
                raises ``FP8FormatError`` for a model that cannot be exported so.

        Tensor lifetime: a yielded tensor is valid until the generator advances. It may be a view
        of a live parameter (then it changes when the parameter does) or, with the cache on, a
        buffer that a later tensor of the same shape overwrites. A caller that keeps a tensor
        must copy it. With the cache off, gathered tensors are fresh allocations.
        """
        chunks = model if isinstance(model, list) else [model]
        model_bridge = self._model_bridge_for(chunks)
        fp8_config = _fp8_config(fp8)
        if fp8_config is not None:
            return self._export_fp8(chunks, fp8_config, reuse_buffer_from_cache, cpu=cpu, show_progress=show_progress)
        fast_path = conversion_tasks is None and weight_dtype is None and self.export_weight_dtype != "fp8"
        if fast_path and self.__dict__.get("_refit_plan_error") is None:
            try:
                exporter = self._exporter(chunks)
            except PlanError as err:
                logger.warning("export plan unavailable (%s): using the stock Megatron-Bridge export", err)
                self.__dict__["_refit_plan_error"] = err
            else:
                buffers = self._export_buffers() if reuse_buffer_from_cache else ExportBuffers(persistent=False)
                return exporter.export(buffers, cpu=cpu, show_progress=show_progress and _is_rank_zero())
        if conversion_tasks is None and self.export_weight_dtype == "fp8":
            self._validate_fp8_export_config(chunks)
            conversion_tasks = model_bridge.build_export_fp8_tasks(self.hf_pretrained, chunks)
        return model_bridge.stream_weights_megatron_to_hf(
            chunks,
            self.hf_pretrained,
            cpu=cpu,
            show_progress=show_progress,
            conversion_tasks=conversion_tasks,
            merge_adapter_weights=merge_adapter_weights,
            weight_dtype=weight_dtype,
        )

    def _export_fp8(
        self, chunks: list[torch.nn.Module], config: BlockwiseFP8Config, reuse_buffer_from_cache: bool, *, cpu: bool, show_progress: bool
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The FP8 stream: weights the trainer keeps as blockwise FP8 are shipped as they are, with
        their scales; high-precision weights are quantized bucket by bucket into (cached) buffers."""
        try:
            fp8 = self._fp8_export(chunks, config)
        except PlanError as err:
            raise FP8FormatError(f"the FP8 export runs from the export plan, which this model has none of: {err}") from err
        buffers = self._export_buffers() if reuse_buffer_from_cache else ExportBuffers(persistent=False)
        buckets = fp8.weights.export_buckets(
            buffers, show_progress=show_progress and _is_rank_zero(), select_rows_lazily=True, bucket_sizes=fp8.bucket_sizes
        )
        stream = quantize_buckets(buckets, fp8.plan, buffers)
        if fp8.scales is not None:
            stream = _with_trainer_scales(stream, fp8.scales.export(buffers), fp8.shipped_scales)
        return ((name, tensor.cpu()) for name, tensor in stream) if cpu else stream

    def export_hf_weights_stock(self, model, **kwargs) -> Iterable[tuple[str, torch.Tensor]]:
        """The unmodified Megatron-Bridge export (for comparison and benchmarks)."""
        chunks = model if isinstance(model, list) else [model]
        return self._model_bridge_for(chunks).stream_weights_megatron_to_hf(chunks, self.hf_pretrained, **{"cpu": False, **kwargs})

    def load_hf_shards(self, model: list[torch.nn.Module], hf_path: str | Path | None = None) -> LoadReport:
        """Load HF safetensors weights into ``model``; each rank reads only its own slices.

        Call on every rank (the task build exchanges parameter names across pipeline stages once).
        ``hf_path`` defaults to the checkpoint this bridge was created from.
        """
        path = Path(hf_path) if hf_path is not None else self._checkpoint_path()
        checkpoint = HFCheckpoint.open(path)
        chunks = model if isinstance(model, list) else [model]
        return load_hf_shards(self._model_bridge_for(chunks), self.hf_pretrained, chunks, checkpoint)

    def _checkpoint_path(self) -> Path:
        path = getattr(self.hf_pretrained, "model_name_or_path", None)
        if path is None or not Path(path).is_dir():
            raise ValueError(
                "this bridge was not created from a local checkpoint directory: pass hf_path= to load_hf_shards"
            )
        return Path(path)


def _fp8_config(fp8: BlockwiseFP8Config | str | None) -> BlockwiseFP8Config | None:
    if fp8 is None or isinstance(fp8, BlockwiseFP8Config):
        return fp8
    if fp8 == "blockwise":
        return BlockwiseFP8Config()
    raise FP8FormatError(f"fp8={fp8!r} is not a known FP8 format: use 'blockwise' or a BlockwiseFP8Config")


def _local_params(tasks: list) -> dict[str, torch.Tensor]:
    """Global Megatron name -> this rank's parameter, for the parameters this rank holds."""
    return {t.global_param_name: t.param_weight for t in tasks if t is not None and t.param_weight is not None}


def _device_of(params: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device if params else torch.device("cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class _FP8Export:
    """What an FP8 export of one model with one config runs (cached by ``RefitBridge._fp8_export``)."""

    base: ExportPlan  # the BF16 plan it was derived from
    config: BlockwiseFP8Config
    plan: ExportPlan  # what the export yields
    weights: PlanExporter
    scales: PlanExporter | None  # scale_inv shards of the weights the trainer keeps as FP8
    shipped_scales: frozenset[str]  # HF names of those weights
    bucket_sizes: dict[str, int]  # bytes yielded per BF16-plan tensor: buckets hold what the FP8 export yields


def _with_trainer_scales(
    weights: Iterable[tuple[str, torch.Tensor]], scales: Iterable[tuple[str, torch.Tensor]], has_scale: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Interleave the trainer-side scale stream after each weight named in ``has_scale``.

    Both streams are collective; every rank advances them at the same points (the plan's), so
    their gathers and pipeline broadcasts are issued in the same order everywhere.
    """
    scales = iter(scales)
    for name, tensor in weights:
        yield name, tensor
        if name in has_scale:
            scale_name, scale = next(scales)
            assert scale_name == fp8_scale_name(name), (scale_name, name)
            yield scale_name, scale


def _is_rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
