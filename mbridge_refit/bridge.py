"""``RefitBridge``: Megatron-Bridge's ``AutoBridge``, extended for per-step weight refit.

Drop-in: ``RefitBridge.from_hf_pretrained`` / ``from_hf_config`` return a ``RefitBridge`` and
every stock method keeps its signature. What changes:

* One ``MegatronModelBridge`` per model. Stock ``AutoBridge._model_bridge`` builds a new one on
  every access, so per-mapping caches (object broadcasts, detected parallelism types, gathered
  parameter names) are lost between calls.
* ``export_plan(model)``: every HF tensor the export yields, in order, with shapes, dtypes,
  owning stage and sharding — built once from metadata, cached per model.
* ``export_hf_weights(..., reuse_buffer_from_cache=...)`` runs that plan
  (``runtime.exporter.PlanExporter``): views where the HF tensor is a slice of the local shard,
  bucketed gathers, and, with the cache on, output buffers owned by the bridge and reused on
  every call, for the stock arguments RL frameworks pass too (``conversion_tasks`` from
  ``get_conversion_tasks``). Models the plan cannot describe (adapters, ...) and arguments it
  cannot honour fall back to the stock export, with the reason (logged once, and in
  ``export_diagnostics``). The model bridge is the one ``_model_bridge`` gives (a subclass's
  override included), kept per model.
* ``load_hf_shards``: HF → Megatron where each rank reads only its own slices from the
  safetensors files (works on CPU at any TP/PP/EP; the stock loader needs CUDA at TP>1).

Everything derived from one model (model bridge, plan, exporters, FP8 export, LoRA adapters)
lives in one ``_ModelState`` record, replaced when the bridge is handed another model; the output
buffers outlive it (``release_export_buffers`` frees them). ``export_diagnostics`` reports what
the export holds, for benchmarks and monitoring. The bridge is the facade of the FP8 export
(``fp8.export``) and of the routes of models with LoRA adapters (``runtime.lora_routing``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, NamedTuple, Optional

import torch
from megatron.bridge import AutoBridge

from mbridge_refit.checkpoints.hf import HFCheckpoint, remote_code_refusal
from mbridge_refit.checkpoints.loader import LoadReport, check_hf_shapes, check_tied_output, load_hf_shards
from mbridge_refit.errors import InputError
from mbridge_refit.fp8 import te as te_fp8
from mbridge_refit.fp8.export import FP8Export, build_fp8_export, fp8_adapters, fp8_buckets, resolve_fp8_config
from mbridge_refit.fp8.format import BlockwiseFP8Config, FP8FormatError
from mbridge_refit.fp8.quantize import block_row_runs
from mbridge_refit.plan.build import build_export_plan
from mbridge_refit.plan.engine_layout import EngineLayout
from mbridge_refit.plan.entries import ExportPlan, PlanError
from mbridge_refit.plan.layout import ModelShape
from mbridge_refit.plan.task_selection import TaskMismatch, names_for_tasks
from mbridge_refit.plan.transfer import TransferPlan, build_transfer_plan
from mbridge_refit.runtime.buffers import ExportBuffers, ReboundOutputError
from mbridge_refit.runtime.collectives import (
    all_true,
    current_groups,
    current_rank_groups,
    current_trainer_rank,
    is_rank_zero,
    replica_participants,
)
from mbridge_refit.runtime.exporter import DEFAULT_BUCKET_BYTES, PlanExporter
from mbridge_refit.runtime.handshake import DEFAULT_TIMEOUT_S, CollectiveCall, CollectiveMisuseError, open_call
from mbridge_refit.runtime.lifetime import (
    HeldOutputs,
    guard_buckets,
    guard_tensors,
    lifetime_checks_from_environment,
)
from mbridge_refit.runtime.live_params import LiveParams, ModelChangedError, params_device, registration_count
from mbridge_refit.runtime.lora import AdapterExport
from mbridge_refit.runtime.lora_routing import (
    ModelAdapters,
    adapter_export_route,
    adapter_tuples,
    merge_route,
    refuse_adapters,
)
from mbridge_refit.runtime.param_sync import finish_pending_param_gathers
from mbridge_refit.runtime.selection import LiveRows
from mbridge_refit.runtime.sharded_transfer import ShardedTransfer

__all__ = ["ExportDiagnostics", "FP8Export", "RefitBridge"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportDiagnostics:
    """What the bridge holds for its current model's export (``RefitBridge.export_diagnostics``)."""

    planned: bool  # whether the plan has been built (False where the model has none)
    tensors: int  # HF tensors one BF16 export yields (0 before planning)
    plan_bytes: int  # bytes one BF16 export yields
    buckets: int  # gather buckets of the BF16 export on this rank
    buffer_bytes: int  # bytes held by the persistent output buffers
    buffers: int  # persistent output buffers
    allocations: int  # tensors the persistent pool has allocated so far (flat in the steady state)
    fallback_reason: str | None  # why the last export ran the stock path (None: it ran the plan)


@dataclass(kw_only=True, slots=True, weakref_slot=True)
class _ModelState:
    """Everything the bridge derives from one model; replaced when the model changes, dropped when
    the model's first chunk is garbage-collected (``_drop_state``). Refers to the chunks weakly;
    its conversion tasks and parameters hold only submodules and parameters, so the chunks can die."""

    chunks: tuple[weakref.ref, ...]  # the model's chunks, as the caller passes them
    model_bridge: Any
    plan: ExportPlan | None = None
    tasks: list | None = None  # the bridge's conversion tasks, with the parameters the model holds now
    live: LiveParams | None = None  # this rank's parameters by global name, kept current
    exporter: PlanExporter | None = None
    plan_error: PlanError | None = None  # why this model has no plan (every rank alike; never retried)
    fallback_reason: str | None = None  # why the last export of this model ran the stock path (None: the plan ran)
    logged: set[str] = field(default_factory=set)  # fallback reasons already logged for this model
    fp8: dict[BlockwiseFP8Config, FP8Export] = field(default_factory=dict)
    participants: dict[int, frozenset[int]] = field(default_factory=dict)  # replica -> ranks its export needs
    group: Any = None  # the ranks the plan was built over (None: the whole job)
    everyone: list[Any] | None = None  # those ranks' RankGroups (one object gather, when replicas are asked for)
    grid: tuple[Any, ...] | None = None  # those ranks' TrainerRank coordinates (one object gather, for transfer plans)
    registrations: int = 0  # ``registration_count()`` when the state was made (a PEFT wrap before planning shows)
    adapters: ModelAdapters | None = None  # the plan's LoRA adapters (``runtime.lora_routing``), made on first use


class RefitBridge(AutoBridge):
    """An ``AutoBridge`` that keeps its model bridge and exports for refit.

    Example:
        >>> bridge = RefitBridge.from_hf_pretrained("/path/to/Qwen3-8B")
        >>> for name, tensor in bridge.export_hf_weights(model, reuse_buffer_from_cache=True):
        ...     engine.load_weight(name, tensor)

    ``bucket_bytes``: the gathers of consecutive whole layers, up to this many output bytes, are
    issued together (one coalesced NCCL group); larger buckets keep more gathered layers alive.
    Set it on every rank alike, before an export.

    Implements ``runtime.weight_source.ExportsWeights``, what refit sessions and other consumers
    that drive an export ask of a bridge.
    """

    def __init__(self, hf_pretrained: Any) -> None:
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.collective_timeout_s: float | None = DEFAULT_TIMEOUT_S
        self.check_lifetime = lifetime_checks_from_environment()
        self._held_outputs = HeldOutputs()  # the checking mode's guards of the last held export
        self._model_state: _ModelState | None = None
        self._buffers: ExportBuffers | None = None
        super().__init__(hf_pretrained)

    @classmethod
    def from_hf_pretrained(cls, path: str | Path, **kwargs: Any) -> "RefitBridge":
        """``AutoBridge.from_hf_pretrained`` with the caller's arguments, ``trust_remote_code``
        included (default False, as stock; True is logged as a warning).

        Without it no code from the checkpoint runs (transformers gets ``trust_remote_code=False``):
        a ``model_type`` transformers has built in loads with its built-in class whatever
        ``auto_map`` says, and a local checkpoint whose architecture exists only as its own code
        (``auto_map`` with an unknown ``model_type``) raises ``RemoteCodeError`` at once, naming
        the opt-in (stock retries the load and reports a load failure). That check reads two keys
        of ``config.json`` as JSON; the config itself is read once, by stock's loader.
        """
        if kwargs.get("trust_remote_code"):
            logger.warning("from_hf_pretrained(%s, trust_remote_code=True): the checkpoint's own code may run", path)
        elif Path(path).is_dir():
            refusal = remote_code_refusal(path)
            if refusal is not None:
                raise refusal
        return super().from_hf_pretrained(path, **kwargs)

    # --- per-model state ----------------------------------------------------------------------

    @property
    def _model_bridge(self):
        """Upstream methods reach the model bridge here: the current model's, once one is known."""
        if self._model_state is not None:
            return self._model_state.model_bridge
        return super()._model_bridge

    def _state_for(self, model: list[torch.nn.Module] | torch.nn.Module) -> _ModelState:
        """The state of ``model``, made anew (with a new model bridge) when the model changes; its
        parameters swapped in where the model replaced them since the last call
        (``runtime.live_params``: one integer comparison when nothing was replaced). The new
        model bridge comes from ``self._model_bridge`` with no state held, so a subclass's (or a
        patch's) ``_model_bridge`` is the one the state keeps."""
        chunks = _chunks(model)
        state = self._model_state
        if state is None or not _same_chunks(state.chunks, chunks) or _rewrapped(state):
            self._model_state = None
            state = self._model_state = _ModelState(
                chunks=tuple(weakref.ref(chunk) for chunk in chunks),
                model_bridge=self._model_bridge,
                registrations=registration_count(),
            )
            weakref.finalize(chunks[0], _drop_state, weakref.ref(self), weakref.ref(state))
        elif state.live is not None:
            if state.adapters is not None:
                state.adapters.refresh()
            replaced = state.live.refresh()
            if replaced:
                state.tasks = _with_current_params(state.tasks, state.live.params, frozenset(replaced))
                logger.info(
                    "%d parameter(s) of the model were replaced since the last export, e.g. %s: reading the new ones",
                    len(replaced),
                    replaced[0],
                )
        state.model_bridge.export_weight_dtype = self.export_weight_dtype
        return state

    def _in_place_change(
        self, chunks: list[torch.nn.Module], reused: ExportBuffers | None = None, alone: bool = False
    ) -> ModelChangedError | ReboundOutputError | None:
        """What the export of ``chunks`` must refuse, found locally before any collective, or None:
        the ``ReboundOutputError`` of a bridge-owned buffer a consumer changed after it was yielded
        (``ExportBuffers.check_pool`` over ``reused``, the pool this export reuses, and the held
        factors of the model's LoRA adapters; not where one rank exports ``alone``: it enters no
        collective, and ``ExportBuffers.get`` checks each buffer as the export asks for it), or the
        ``ModelChangedError`` of a planned parameter of ``chunks`` changed in place
        (``LiveParams.check_in_place``: another dtype, a storage emptied; a model not planned yet has
        nothing to check). Once per export call, before its
        handshake, which shares the verdict with every rank (``_begin_collective``). A buffer
        rebound during the export, between its buckets, is found by ``ExportBuffers.get`` on that
        rank only."""
        state = self._model_state
        planned = state is not None and _same_chunks(state.chunks, chunks)
        adapters = state.adapters if planned else None
        try:
            if not alone:
                if reused is not None:
                    reused.check_pool()
                if adapters is not None and adapters.export is not None:
                    adapters.export.held.check_pool()
            if planned and state.live is not None:
                state.live.check_in_place()
            if adapters is not None:
                adapters.check_in_place()
        except (ModelChangedError, ReboundOutputError) as err:
            return err
        return None

    def forget_model(self) -> None:
        """Drop everything derived from the current model (plan, exporters, parameter references);
        the next call plans again (collective). For a model changed in a way the plan cannot
        follow (a parameter of another shape): call on every rank, then export."""
        self._model_state = None

    def megatron_model_bridge(self, model: list[torch.nn.Module] | torch.nn.Module) -> Any:
        """The Megatron-Bridge ``MegatronModelBridge`` this bridge uses for ``model`` (kept for the
        model's lifetime in this bridge, so its caches survive between exports)."""
        return self._state_for(model).model_bridge

    def _planned(self, chunks: list[torch.nn.Module], group=None) -> _ModelState:
        """The state of ``chunks`` with its plan and conversion tasks built (once per model).

        Raises ``PlanError`` where the model has no plan, on every rank alike: a failure of this
        rank's part (building the tasks, describing a parameter: any exception) travels to every
        rank with the plan's one object exchange (``RankContribution.errors``), a failure of the
        assembly is the same everywhere (it is pure), and the verdict is kept (never retried).
        """
        state = self._state_for(chunks)
        if state.plan_error is not None:
            raise state.plan_error
        if state.plan is None:
            try:
                state.plan, state.tasks = self._build_plan(state.model_bridge, chunks, group)
                state.live = LiveParams(_unwrapped(chunks), state.tasks)
            except PlanError as err:
                state.plan_error = err
                raise
            except Exception as err:
                state.plan_error = PlanError(f"planning failed: {_describe(err)}")
                raise state.plan_error from err
            state.group = group
        return state

    def _build_plan(self, model_bridge: Any, chunks: list[torch.nn.Module], group: Any) -> tuple[ExportPlan, list]:
        from megatron.core.utils import unwrap_model

        unwrapped = unwrap_model(chunks)
        try:
            tasks, failure = model_bridge.build_conversion_tasks(self.hf_pretrained, unwrapped), ()
        except Exception as err:  # still take part in the plan's exchange, so every rank learns of it
            tasks, failure = [], (f"building the conversion tasks failed: {_describe(err)}",)
        plan = build_export_plan(model_bridge, self.hf_pretrained, unwrapped, tasks=tasks, group=group, errors=failure)
        return plan, tasks

    def _exporter(self, chunks: list[torch.nn.Module]) -> PlanExporter:
        state = self._planned(chunks)
        if state.exporter is None:
            params = state.live.params
            shards = te_fp8.dequantized_shards(params) if te_fp8.has_quantized_params(params) else None
            state.exporter = PlanExporter(
                plan=state.plan, params=params, device=params_device(params), shards=shards, moves=state.live.moves
            )
        state.exporter.bucket_bytes = self.bucket_bytes
        return state.exporter

    def _adapter_export(self, chunks: list[torch.nn.Module]) -> AdapterExport | None:
        """The export of the model's LoRA adapters (``plan.lora``), None for a model without any.
        Collective on the first call for a model; raises ``PlanError`` on every rank alike for
        adapters the plan does not describe (kept: never retried)."""
        state = self._planned(chunks)
        if state.adapters is None:
            state.adapters = ModelAdapters.of(state.plan)
        return state.adapters.built(
            state.model_bridge, chunks, state.plan, state.tasks, state.group, params_device(state.live.params)
        )

    def _reused_buffers(self, options: "_ExportOptions") -> ExportBuffers | None:
        """The pool an export with ``options`` reuses (``_export_buffers`` keeps it), None where it
        makes a new one."""
        buffers = self._buffers
        if (
            options.reuse_buffer_from_cache
            and buffers is not None
            and buffers.hold_whole_export == options.hold_outputs
        ):
            return buffers
        return None

    def _export_buffers(self, persistent: bool, hold_outputs: bool = False) -> ExportBuffers:
        if hold_outputs and not persistent:
            raise ValueError("hold_outputs=True needs reuse_buffer_from_cache=True (the held outputs are the cache)")
        if not persistent:
            return ExportBuffers(persistent=False)
        if self._buffers is None or self._buffers.hold_whole_export != hold_outputs:
            if self._buffers is not None:
                self._buffers.release()
            self._buffers = ExportBuffers(persistent=True, hold_whole_export=hold_outputs)
        return self._buffers

    # --- public API -----------------------------------------------------------------------------

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
        chunks = _chunks(model)
        plan = self._planned(chunks, group).plan
        config = self.fp8_config(fp8)
        return plan if config is None else self.fp8_export(chunks, config).plan

    def fp8_config(self, fp8: BlockwiseFP8Config | str | None) -> BlockwiseFP8Config | None:
        """The config an export with ``fp8=fp8`` runs: ``"blockwise"`` or a ``BlockwiseFP8Config``
        without ``keep_patterns`` gets the keep patterns of this model's family (``fp8.keep``, by
        the HF config's ``architectures[0]``); explicit ``keep_patterns`` are kept as given."""
        if fp8 is None:
            return None
        architectures = getattr(self._hf_config(), "architectures", None) or [None]
        return resolve_fp8_config(fp8, architectures[0])

    def fp8_export(self, model: list[torch.nn.Module] | torch.nn.Module, config: BlockwiseFP8Config | str) -> FP8Export:
        """The FP8 plan for ``config`` and the exporters that run it; built once per model and config.

        Weights: the BF16 plan where weights the trainer keeps as blockwise FP8 are read as their
        e4m3 data (the BF16 exporter itself when there are none). Scales: those weights'
        ``scale_inv`` shards (None when the model has none). Collective on the first call (the
        plan); raises ``FP8FormatError`` for a model that cannot be exported so.
        """
        chunks, config = _chunks(model), self.fp8_config(config)
        try:
            state = self._planned(chunks)
        except PlanError as err:
            raise FP8FormatError(
                f"the FP8 export runs from the export plan, which this model has none of: {err}"
            ) from err
        weights = self._exporter(chunks)
        cached = state.fp8.get(config)
        if cached is None:
            cached = state.fp8[config] = build_fp8_export(state.plan, config, weights, state.live.params)
        cached.weights.bucket_bytes = self.bucket_bytes
        return cached

    def live_rows(
        self, model: list[torch.nn.Module] | torch.nn.Module, *, fp8: BlockwiseFP8Config | str | None = None
    ) -> dict[str, LiveRows]:
        """HF names of ``export_hf_weights(model, fp8=fp8)`` whose tensor is, on this rank, rows of
        one local parameter read as stored, with those rows (``runtime.selection.LiveRows``):
        views of the parameter (most tensors without tensor parallelism) and row runs of one
        (q, k, v of grouped-query attention). A consumer that maps the parameter's memory reads
        every later step's weights there without exporting these names again.

        Nothing else is live: gathered or pipeline-broadcast tensors, tensors the FP8 export
        quantizes, shards converted on the way (TE FP8 parameters), tensors whose export applies
        an elementwise op (Qwen3-Next's zero-centred norms, ``+ 1``). The same names on every rank
        of the model's groups (they depend on the plan and the layout), so every rank can export
        the rest with ``only=`` in step. Empty for a model the plan cannot describe (the stock
        fallback). Collective on the first call for a model (the plan), like ``export_plan``.
        The parameters are referenced, not copied: a parameter whose ``.data`` is swapped is
        followed (``LiveRows.source()``), its rows' meaning is not.
        """
        chunks, config = _chunks(model), self.fp8_config(fp8)
        live, scales = self._live_and_scales(chunks, config)
        return {name: rows for name, rows in live.items() if name not in scales}

    def quantized_live_rows(
        self, model: list[torch.nn.Module] | torch.nn.Module, *, fp8: BlockwiseFP8Config | str
    ) -> dict[str, tuple[LiveRows, str]]:
        """The weights ``export_hf_weights(model, fp8=fp8)`` quantizes whose BF16 tensor is, on this
        rank, rows of one local parameter read as stored (``live_rows`` without FP8) in whole 128-row
        blocks (``fp8.quantize.block_row_runs``), each with those rows and the HF name of its
        ``weight_scale_inv``. Quantizing those rows block by block gives the export's bits, so a
        consumer that maps the parameter's memory can quantize them itself every step instead of
        having them exported (``engines.ipc.trainer``); ``export_hf_weights(only=...)`` then leaves out
        the weight and its scale alike. Same rules as ``live_rows`` (collective on a model's first
        call; the same names on every rank of the model's groups); empty where the FP8 export reads
        converted shards (the trainer keeps FP8 parameters)."""
        live, scales = self._live_and_scales(_chunks(model), self.fp8_config(fp8))
        return {
            name: (rows, scales[name])
            for name, rows in live.items()
            if name in scales and len(rows.shape) == 2 and block_row_runs(rows.runs, rows.shape[0])
        }

    def _live_and_scales(self, chunks: list, config: BlockwiseFP8Config | None) -> tuple[dict[str, LiveRows], dict]:
        """``live_rows`` without FP8, and the FP8 export's scale name per quantized weight (``{}``
        without FP8); both empty where nothing of the model is live."""
        if self.export_weight_dtype == "fp8":
            return {}, {}  # Megatron-Bridge's own FP8 export runs instead of the plan
        try:
            exporter = self._exporter(chunks)
        except PlanError:
            return {}, {}
        live = exporter.live_rows()
        try:
            lora = self._adapter_export(chunks)
        except PlanError:
            return {}, {}  # the stock path exports this model
        if lora is not None:  # merged weights are rows of no parameter
            live = {name: rows for name, rows in live.items() if name not in lora.targets}
        if config is None:
            return live, {}
        fp8_export = self.fp8_export(chunks, config)
        if fp8_export.weights is not exporter:
            return {}, {}  # weights read through converted shards (the trainer keeps FP8 parameters)
        return live, fp8_export.scale_names()

    def takes_part(self, model: list[torch.nn.Module] | torch.nn.Module, replica: int) -> bool:
        """Whether this rank does export work in ``export_hf_weights(model, replica=replica)``.

        Collective on the first call for a model and replica (plan, then one object gather of
        the groups of every rank the plan was built over); cached afterwards. True on every rank where the model has no plan
        (the stock fallback needs them all).
        """
        chunks = _chunks(model)
        try:
            state = self._planned(chunks)
        except PlanError:
            return True
        return torch.distributed.get_rank() in self._participants(state, replica)

    def replica_ranks(self, model: list[torch.nn.Module] | torch.nn.Module) -> tuple[frozenset[int], ...]:
        """For each data-parallel replica (index = its data-parallel rank), the global ranks its
        export needs: its own and, where expert-parallel groups span replicas, theirs (then the
        sets overlap). Any of them receives the full tensors, so a single sender of replica r
        (packed broadcast) can be ``min(bridge.replica_ranks(model)[r])``. Collective on the
        first call for a model over the ranks the plan is built over (``export_plan(group=)``);
        the same on every one of them."""
        state = self._planned(_chunks(model))
        replicas = sorted({r.replica for r in self._everyone(state)})
        return tuple(self._participants(state, r) for r in replicas)

    def transfer_plan(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        engine: EngineLayout | str,
        *,
        engine_ranks: Iterable[int] | None = None,
        only: Iterable[str] | None = None,
    ) -> TransferPlan:
        """The sharded refit of ``model`` into an engine laid out as ``engine`` (``"tp2"``,
        ``EngineLayout(tp=4)``), engine rank i on global rank ``engine_ranks[i]`` (default i):
        which slice of which HF tensor each engine rank gets, from which trainer rank.

        Collective on the first call for a model over the ranks the plan is built over (the plan,
        then one object gather of every rank's grid coordinates); pure and cheap afterwards. The
        same on every rank; ``to_json`` hands it to engine processes. Raises
        ``EngineShardingError`` / ``TransferPlanError`` naming the tensor an engine cannot slice.
        """
        state = self._planned(_chunks(model))
        refuse_adapters(state.plan, "a transfer plan")
        if state.grid is None:
            grid: list[Any] = [None] * torch.distributed.get_world_size(state.group)
            torch.distributed.all_gather_object(grid, current_trainer_rank(), group=state.group)
            state.grid = tuple(grid)
        engine = EngineLayout.parse(engine) if isinstance(engine, str) else engine
        shape = ModelShape.from_hf_config(self._hf_config())
        return build_transfer_plan(state.plan, state.grid, engine, shape, engine_ranks=engine_ranks, only=only)

    def sharded_transfer(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        plan: TransferPlan,
        *,
        group: Any = None,
        checksum: bool = False,
        check_replicas: bool = True,
    ) -> ShardedTransfer:
        """A ``ShardedTransfer`` of ``plan`` reading this rank's parameters of ``model``; its ``run``
        first completes Megatron DDP's deferred parameter gathers. Build it once on every rank
        of ``group`` (default: the whole job) and call ``run(shards)`` every step. No collective.
        ``check_replicas``: the first run compares the copies of tensors several ranks send
        (``runtime.replica_agreement``); the same value on every rank."""
        chunks = _chunks(model)
        state = self._planned(chunks)
        refuse_adapters(state.plan, "a sharded transfer")
        return ShardedTransfer(
            plan,
            params=state.live.params,
            group=group,
            checksum=checksum,
            chunks=chunks,
            check_replicas=check_replicas,
            current_params=lambda: self._live_params_of(chunks),  # replaced parameters followed every run
        )

    def _live_params_of(self, chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The parameters of the planned model ``chunks``, looked up again where the model replaced them
        (``_state_for``: local, never a collective). Raises ``InputError`` where the bridge no longer holds
        this model's plan (``forget_model()``, another model exported since, the model rewrapped): planning
        again is collective, which a transfer's run must not start on one rank."""
        state = self._model_state
        if state is not None and _same_chunks(state.chunks, chunks) and state.live is not None:
            state = self._state_for(chunks)
        if state is None or not _same_chunks(state.chunks, chunks) or state.live is None:
            raise InputError(
                "the bridge no longer holds the plan of this transfer's model (forget_model(), another model "
                "exported with the bridge, or the model rewrapped): build the transfer again with "
                "bridge.sharded_transfer(...) on every rank"
            )
        return state.live.params

    def _everyone(self, state: _ModelState) -> list[Any]:
        """Every trainer rank's groups, gathered over the ranks the plan was built over."""
        if state.everyone is None:
            state.everyone = [None] * torch.distributed.get_world_size(state.group)
            torch.distributed.all_gather_object(state.everyone, current_rank_groups(), group=state.group)
        return state.everyone

    def _participants(self, state: _ModelState, replica: int) -> frozenset[int]:
        if replica not in state.participants:
            state.participants[replica] = replica_participants(self._everyone(state), replica)
        return state.participants[replica]

    def export_diagnostics(self) -> ExportDiagnostics:
        """What this bridge holds for the model it exported last (local to this rank; no collective)."""
        state, buffers = self._model_state, self._buffers
        plan = state.plan if state is not None else None
        exporter = state.exporter if state is not None else None
        reason = state.fallback_reason if state is not None else None
        if reason is None and state is not None and state.plan_error is not None:
            reason = f"no export plan for this model: {state.plan_error}"
        return ExportDiagnostics(
            planned=plan is not None,
            tensors=len(plan.entries) if plan is not None else 0,
            plan_bytes=plan.total_bytes if plan is not None else 0,
            buckets=len(exporter.buckets()) if exporter is not None else 0,
            buffer_bytes=buffers.nbytes if buffers is not None else 0,
            buffers=len(buffers) if buffers is not None else 0,
            allocations=buffers.allocations if buffers is not None else 0,
            fallback_reason=reason,
        )

    def release_export_buffers(self) -> None:
        """Free the buffers kept by ``export_hf_weights(..., reuse_buffer_from_cache=True)``, and the
        views of parameters the exporters keep between exports (with them, the storages of parameters
        swapped out since: ``param.data = ...``, an offload); the next export makes them anew."""
        if self._buffers is not None:
            self._buffers.release()
            self._buffers = None
        state = self._model_state
        if state is None:
            return
        if state.adapters is not None:
            state.adapters.release()
        for exporter in (state.exporter, *(e for f in state.fp8.values() for e in (f.weights, f.scales))):
            if exporter is not None:
                exporter.release_views()

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
        hold_outputs: bool = False,
        fp8: BlockwiseFP8Config | str | None = None,
        replica: int | None = None,
        only: Collection[str] | None = None,
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every HF weight of ``model``, in the bridge's order.

        Collective: every rank of the model's process groups must iterate the generator to the
        end, in step (each yielded tensor may need a gather or pipeline broadcast). Every rank
        receives the full HF tensors. The stock positional arguments are unchanged. Checked
        (``runtime.handshake``, within ``collective_timeout_s``; ``None`` turns the checks off):
        a rank whose peers do not call it, or that leaves early, is named with
        ``CollectiveMisuseError``; and one export at a time per process: a call (this one,
        ``export_hf_weight_buckets``, ``export_adapter_weights``) while an export (this bridge's
        previous one or another bridge's) is still open on any rank (neither iterated to its end
        nor closed) raises
        ``CollectiveMisuseError`` on every rank, before any collective. Finish or close the first
        export, on every rank, before starting another (closing one runs its rest, with the peers).

        Data-parallel replicas (world = tp x pp x cp x dp): gathers run inside each replica's
        tensor/pipeline/expert groups, so by default every rank of every replica exports (the
        stock contract). With ``replica=r`` only the ranks replica r's export needs (its own,
        plus ranks sharing an expert-parallel group with them, transitively) do export work; every
        other rank gets an empty iterator and issues no gather and touches no buffer. Every rank
        must still call this with the same ``replica`` (the first call for a model builds the
        plan and the participant set collectively); the ranks that get tensors iterate to the end.
        A model the plan cannot describe falls back to the stock export on every rank, and so
        does a call whose stock arguments the plan cannot honour (see ``conversion_tasks``,
        ``weight_dtype``; ``export_weight_dtype='fp8'``), with the reason (``export_diagnostics``).

        Args:
            model: the Megatron model chunks (one per virtual pipeline stage), wrapped or not.
            cpu: move each tensor to CPU before yielding it.
            show_progress: progress bar on rank 0.
            conversion_tasks: tasks from ``get_conversion_tasks(model)``: all of them (``None``
                dropped, as NeMo-RL passes them) or a part, in their order. The export yields what
                stock yields for them (their tensors, in their order), from the plan. Tasks the plan
                does not stand for (another model's, carrying replaced tensors, out of order, a lazy
                iterable: ``plan.task_selection``) run the stock path instead, every rank alike
                (one all-reduce of one integer per call agrees on it), the reason logged once and
                kept in ``export_diagnostics().fallback_reason``.
            merge_adapter_weights: as stock; the plan covers only models without adapters, where it
                changes nothing.
            weight_dtype: as stock. The plan runs it where every floating-point tensor of the
                export has that dtype already (stock's cast is then the identity); another dtype
                runs the stock path (which casts), with the reason.
            reuse_buffer_from_cache: write outputs into buffers owned by this bridge, allocated on
                the first call and reused by every later call (steady-state exports allocate
                nothing). Free them with ``release_export_buffers()``.
            hold_outputs: with ``reuse_buffer_from_cache``, every yielded tensor stays valid and in
                place until the next export call (one cached buffer per output, not per bucket
                position). For consumers that read the export after it ended, e.g. an engine
                mapping these tensors by CUDA IPC (``engines.ipc.engine``). Switching the mode of a
                bridge frees its cache.
            fp8: ``"blockwise"`` (or a ``BlockwiseFP8Config``) quantizes BF16/FP32 linear weights on
                export to 128x128-blockwise e4m3fn, each followed by its fp32 ``weight_scale_inv``
                (``export_plan(model, fp8=...)`` lists them). Checked before any export work:
                raises ``FP8FormatError`` for a model that cannot be exported so.
            only: yield only these HF names (of the plan, or with ``fp8`` of the FP8 plan), in
                plan order; parameters that yield none of them are not gathered. Every rank of the
                model's groups passes the same names: one data-parallel replica exporting its
                share of a checkpoint (``convert`` writes so). Raises ``KeyError`` for a name the
                export does not yield.

        Fresh weights: the export reads the model's parameters, in the model's dtype (e.g. bf16
        parameters of a model trained with fp32 main parameters in the optimizer; never the
        optimizer's copies). For a model wrapped in Megatron DDP whose parameter all-gathers are
        deferred to the next forward pass (distributed optimizer with ``overlap_param_gather``),
        this call first completes every pending gather (``runtime.param_sync``), so an export
        right after ``optimizer.step()`` yields the updated weights on every rank.

        Tensor lifetime: a yielded tensor is valid until the generator advances. It may be a view
        of a live parameter (then it changes when the parameter does) or, with the cache on, a
        buffer that a later tensor of the same shape overwrites. A caller that keeps a tensor
        must copy it. With the cache off, gathered tensors are fresh allocations. With
        ``hold_outputs`` every yielded tensor stays valid until the next export call.
        """
        options = _ExportOptions(
            stock=_StockArguments(cpu, show_progress, conversion_tasks, merge_adapter_weights, weight_dtype),
            reuse_buffer_from_cache=reuse_buffer_from_cache,
            hold_outputs=hold_outputs,
            fp8=fp8,
            replica=replica,
            only=only,
        )
        return self._export_call(model, "export_hf_weights", options, in_buckets=False)

    def export_hf_weight_buckets(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        *,
        cpu: bool = False,
        show_progress: bool = True,
        reuse_buffer_from_cache: bool = False,
        hold_outputs: bool = False,
        fp8: BlockwiseFP8Config | str | None = None,
        replica: int | None = None,
        only: Collection[str] | None = None,
    ) -> Iterable[list[tuple[str, torch.Tensor]]]:
        """``export_hf_weights``, one bucket at a time: lists of ``(hf_name, tensor)`` in plan order.

        For packers that collect tensors and send them together (an HTTP or ZMQ flush, a packed
        buffer): every tensor of a bucket stays valid until the next bucket is requested, so a
        bucket can be sent whole without copying; what is kept longer must be copied. Buckets are
        the export's own (``bucket_bytes`` of output, whole layers; with ``fp8``, sized by what the
        FP8 export yields); a model on the stock fallback is cut into lists of ``bucket_bytes``.
        Collective and fresh exactly as ``export_hf_weights`` (same arguments, same contract).
        Each list is the caller's. Some come as a ``runtime.stamps.StampedBucket``: every bucket with
        one stamp, from the first export that made it on, holds the same pair objects where they were,
        so a consumer that saw the stamp can skip looking at each tensor again.
        """
        options = _ExportOptions(
            stock=_StockArguments(cpu, show_progress),
            reuse_buffer_from_cache=reuse_buffer_from_cache,
            hold_outputs=hold_outputs,
            fp8=fp8,
            replica=replica,
            only=only,
        )
        return self._export_call(model, "export_hf_weight_buckets", options, in_buckets=True)

    def _export_call(self, model: Any, what: str, options: "_ExportOptions", *, in_buckets: bool) -> Iterable:
        """One public export call: the handshake (``runtime.handshake``), the export, and the tensors'
        lifetime checks when ``check_lifetime`` is on."""
        chunks = _chunks(model)
        call = self._begin_collective(chunks, what, self._reused_buffers(options))
        self._held_outputs.expire()  # the last held export's tensors end where this export begins
        exported = self._export(chunks, options, in_buckets=in_buckets)
        stream = call.guard(exported, issues_collectives=not isinstance(exported, _NoExportWork))
        if not self.check_lifetime:
            return stream
        if options.hold_outputs:
            return self._held_outputs.guard(stream, in_buckets=in_buckets)
        return guard_buckets(stream) if in_buckets else guard_tensors(stream)

    def _begin_collective(
        self, chunks: list[torch.nn.Module], what: str, reused: ExportBuffers | None = None
    ) -> CollectiveCall:
        """Check that every rank the export needs calls it, that none has an export still open
        (of this bridge or another: ``runtime.handshake``), and that no rank's model or bridge-owned
        buffers (``reused``: the pool the export reuses) changed in place (``_in_place_change``),
        refused on every rank alike, before any collective."""
        state = (
            self._model_state
            if self._model_state is not None and _same_chunks(self._model_state.chunks, chunks)
            else None
        )
        group = state.group if state is not None else None
        participants = (
            torch.distributed.get_process_group_ranks(group)
            if group is not None
            else range(torch.distributed.get_world_size())
        )
        call = CollectiveCall(what, participants, timeout_s=self.collective_timeout_s)
        last = open_call()
        changed = self._in_place_change(chunks, reused, alone=len(participants) == 1)  # refused on every rank alike
        refusal = str(changed) if changed is not None else None
        if refusal is None and last is not None:
            refusal = _still_open(last, what)
        try:
            call.arrive(refusal=refusal)
        except CollectiveMisuseError as err:
            if changed is not None:
                raise changed from err
            raise
        if changed is not None:  # no store to post it to (one process)
            raise changed
        return call

    def _export(self, model: Any, options: "_ExportOptions", *, in_buckets: bool) -> Iterable:
        """The export stream (tensor by tensor, or ``in_buckets``): the plan's fast path, its FP8
        form, or the stock export where the plan cannot run what the caller asked (the reason
        logged once and kept in ``export_diagnostics().fallback_reason``)."""
        chunks, stock = _chunks(model), options.stock
        state = self._state_for(chunks)  # a model changed in place was refused by the handshake (_in_place_change)
        finish_pending_param_gathers(chunks)  # before any rank skips: collective over data-parallel groups
        fp8_config = self.fp8_config(options.fp8)
        if fp8_config is not None and (stock.conversion_tasks is not None or stock.weight_dtype is not None):
            raise ValueError(
                "fp8= exports the plan as blockwise FP8; conversion_tasks and weight_dtype shape stock's export: pass "
                "one or the other (select the FP8 export's tensors with only=)"
            )
        route = None
        if fp8_config is None and stock.conversion_tasks is not None:  # agreed over every rank, before any leaves
            route = self._route(state, chunks, options)
        if self.export_weight_dtype != "fp8":
            self._lora_route(chunks, stock.merge_adapter_weights)  # collective once per model: before replicas part
        if options.replica is not None and not self.takes_part(chunks, options.replica):
            return _NoExportWork()
        show_progress = stock.show_progress and is_rank_zero()
        if fp8_config is not None:
            buffers = self._export_buffers(options.reuse_buffer_from_cache, options.hold_outputs)
            fp8 = self.fp8_export(chunks, fp8_config)
            lora = fp8_adapters(functools.partial(self._adapter_export, chunks), fp8)
            buckets = fp8_buckets(
                fp8, lora, buffers, show_progress=show_progress, only=options.only, in_buckets=in_buckets
            )
            return _on_cpu(buckets, stock.cpu) if in_buckets else _flat(_on_cpu(buckets, stock.cpu))
        route = route or self._route(state, chunks, options)
        state.fallback_reason = route.reason
        if route.reason is None:
            buffers = self._export_buffers(options.reuse_buffer_from_cache, options.hold_outputs)
            needed = _selected(options.only, route.names, state.plan)
            if route.lora is not None:  # adapted weights merged on their way out
                buckets = route.exporter.export_buckets(buffers, show_progress=show_progress, needed=needed)
                buckets = _on_cpu(route.lora.merged(buckets, buffers), stock.cpu)
                return buckets if in_buckets else _flat(buckets)
            if in_buckets:
                return _on_cpu(
                    route.exporter.export_buckets(buffers, show_progress=show_progress, needed=needed), stock.cpu
                )
            return route.exporter.export(buffers, cpu=stock.cpu, show_progress=show_progress, needed=needed)
        if route.reason not in state.logged:
            state.logged.add(route.reason)
            logger.warning("export_hf_weights runs the stock Megatron-Bridge export: %s", route.reason)
        stream = self._stock_stream(model, state, options)
        return _in_lists(stream, self.bucket_bytes) if in_buckets else stream

    def _stock_stream(
        self, model: Any, state: _ModelState, options: "_ExportOptions"
    ) -> Iterable[tuple[str, torch.Tensor]]:
        conversion_tasks = options.stock.conversion_tasks
        if conversion_tasks is None and self.export_weight_dtype == "fp8":
            model = _chunks(model)
            self._validate_fp8_export_config(model)
            conversion_tasks = state.model_bridge.build_export_fp8_tasks(self.hf_pretrained, model)
        stream = state.model_bridge.stream_weights_megatron_to_hf(
            model,  # as given, as stock passes it
            self.hf_pretrained,
            **options.stock._replace(conversion_tasks=conversion_tasks)._asdict(),
        )
        return stream if options.only is None else _only(stream, options.only)

    def _route(self, state: _ModelState, chunks: list[torch.nn.Module], options: "_ExportOptions") -> "_Route":
        """How ``export_hf_weights`` runs with these stock arguments: the plan (its exporter and, for
        ``conversion_tasks``, the names they stand for), or the stock path with the reason. The same
        on every rank: each input but the tasks' tensors is the same everywhere (the plan's verdict
        travels with its exchange), and a verdict on conversion_tasks is agreed over the plan's
        ranks (one all-reduce of one integer per call that passes them). A model with LoRA
        adapters runs the plan with its adapters merged (``runtime.lora``), or the stock path
        where the adapters have no plan or ``merge_adapter_weights`` is False."""
        conversion_tasks, weight_dtype = options.stock.conversion_tasks, options.stock.weight_dtype
        if self.export_weight_dtype == "fp8":
            return _Route(reason="export_weight_dtype='fp8' selects Megatron-Bridge's own FP8 export")
        if conversion_tasks is not None and weight_dtype is not None:
            return _Route(reason="weight_dtype with conversion_tasks (the stock export refuses the pair)")
        try:
            exporter = self._exporter(chunks)
        except Exception as err:  # PlanError on every rank alike (``_planned``), or this rank's exporter failed
            return _Route(reason=f"no export plan for this model: {_describe(err)}")
        lora, reason = self._lora_route(chunks, options.stock.merge_adapter_weights)
        if reason is not None:
            return _Route(reason=reason)
        if weight_dtype is not None:
            dtypes = {e.dtype for e in state.plan.entries if e.torch_dtype.is_floating_point}
            cast = sorted(dtypes - {str(weight_dtype).removeprefix("torch.")})
            if cast:
                return _Route(reason=f"weight_dtype={weight_dtype} casts the export's {', '.join(cast)} tensors")
        if conversion_tasks is None:
            return _Route(exporter=exporter, lora=lora)
        try:
            ep_rank = current_groups().ep_rank
            names, mismatch = names_for_tasks(conversion_tasks, state.tasks, state.plan, ep_rank=ep_rank), None
        except TaskMismatch as err:
            names, mismatch = None, str(err)
        if not all_true(mismatch is None, state.group, exporter.device):
            return _Route(reason=mismatch or "another rank's conversion_tasks are not its model's tasks (see its log)")
        return _Route(exporter=exporter, names=names, lora=lora)

    def _lora_route(self, chunks: list[torch.nn.Module], merge: bool) -> tuple[AdapterExport | None, str | None]:
        """``(the adapters' export, None)`` for the plan (None: the model has no adapters), or
        ``(None, why the stock path runs)``: ``runtime.lora_routing.merge_route`` of this model's."""
        return merge_route(functools.partial(self._adapter_export, chunks), merge)

    def export_adapter_weights(
        self,
        model: list[torch.nn.Module] | torch.nn.Module,
        cpu: bool = True,
        show_progress: bool = True,
        exclude_adapter_base_prefixes: Iterable[str] | None = None,
        *,
        reuse_buffer_from_cache: bool = False,
    ) -> Iterable[Any]:
        """Stock's adapter export from the adapters' plan: ``HFWeightTuple(name, tensor)`` with
        PEFT's names (``model.layers.0.self_attn.q_proj.lora_A.weight``, ``...lora_B.weight``: A
        then B per adapted HF weight, in stock's order), gathered over TP/PP as stock gathers them.

        Collective like ``export_hf_weights``. With ``reuse_buffer_from_cache`` the tensors are
        views of the adapters' parameters or buffers this bridge holds, all valid until the next
        export of this model (none allocated after the first call); otherwise each is a copy the
        caller keeps. Adapters the plan does not describe (see ``plan.lora``) and
        ``exclude_adapter_base_prefixes`` run the stock export, with the reason
        (``export_diagnostics().fallback_reason``). ``adapter_facts`` gives what
        ``adapter_config.json`` says of them.
        """
        from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

        chunks = _chunks(model)
        call = self._begin_collective(chunks, "export_adapter_weights")
        state = self._state_for(chunks)
        lora, reason = adapter_export_route(
            functools.partial(self._adapter_export, chunks), exclude_adapter_base_prefixes
        )
        state.fallback_reason = reason
        if lora is None:
            logger.warning("export_adapter_weights runs the stock Megatron-Bridge export: %s", reason)
            # A fresh model bridge, as stock makes one per call: the kept one has built the model's
            # conversion tasks from the checkpoint, which switches a packed-expert checkpoint's
            # bridge to its packed mappings, and its adapter export then names every expert's
            # factors alike (Qwen3.5-MoE packed: 160 tensors under 48 names, stock's 224 names).
            stream = super()._model_bridge.stream_adapter_weights_megatron_to_hf(
                chunks,
                cpu=cpu,
                show_progress=show_progress,
                exclude_adapter_base_prefixes=exclude_adapter_base_prefixes,
            )
            return call.guard(stream)
        return call.guard(adapter_tuples(lora.stream(), HFWeightTuple, cpu=cpu, keep=not reuse_buffer_from_cache))

    def adapter_facts(self, model: list[torch.nn.Module] | torch.nn.Module) -> dict[str, Any]:
        """What an HF PEFT ``adapter_config.json`` says of the model's LoRA adapters: ``r``,
        ``lora_alpha``, ``target_modules`` (and rank / alpha patterns where modules differ).
        Collective on the first call for a model (the adapters' plan); raises ``PlanError`` for
        a model without adapters or with adapters the plan does not describe."""
        lora = self._adapter_export(_chunks(model))
        if lora is None:
            raise PlanError("the model has no LoRA adapters")
        return lora.lora.facts()

    def export_hf_weights_stock(self, model, **kwargs) -> Iterable[tuple[str, torch.Tensor]]:
        """The unmodified Megatron-Bridge export (for comparison and benchmarks)."""
        chunks = _chunks(model)
        return self.megatron_model_bridge(chunks).stream_weights_megatron_to_hf(
            chunks, self.hf_pretrained, **{"cpu": False, **kwargs}
        )

    def load_hf_shards(
        self, model: list[torch.nn.Module], hf_path: str | Path | None = None, *, show_progress: bool = False
    ) -> LoadReport:
        """Load HF safetensors weights into ``model``; each rank reads only its own slices (with
        ``show_progress``, a progress bar on rank 0).

        Call on every rank (the task build exchanges parameter names across pipeline stages once).
        ``hf_path`` defaults to the checkpoint this bridge was created from. Raises a ``LoadError``
        (an ``InputError``) on every rank of the model where the checkpoint does not fit it, e.g.
        ``TiedOutputError`` for a tied model whose checkpoint stores a different output weight
        (``check_tied_output``).
        """
        path = Path(hf_path) if hf_path is not None else self._checkpoint_path()
        checkpoint = HFCheckpoint.open(path)
        chunks = _chunks(model)
        return load_hf_shards(
            self.megatron_model_bridge(chunks),
            self.hf_pretrained,
            chunks,
            checkpoint,
            show_progress=show_progress and is_rank_zero(),
        )

    def check_hf_shapes(self, model: list[torch.nn.Module], hf_path: str | Path | None = None) -> None:
        """Every name and shape check of ``load_hf_shards``, reading no data and writing no
        parameter (``model`` may be on the meta device); collective like ``load_hf_shards``."""
        path = Path(hf_path) if hf_path is not None else self._checkpoint_path()
        chunks = _chunks(model)
        check_hf_shapes(self.megatron_model_bridge(chunks), self.hf_pretrained, chunks, HFCheckpoint.open(path))

    def check_tied_output(self, hf_path: str | Path | None = None, provider: Any = None) -> None:
        """Raise ``TiedOutputError`` (an ``InputError``) where the model ties its output layer to the
        embedding (``tie_word_embeddings``) and the HF checkpoint at ``hf_path`` stores an output
        weight of its own (``lm_head.weight``) that differs from the embedding: loading drops it
        (stock does too) and every export writes the embedding under its name. ``load_hf_shards``
        makes the same check; this one needs no model and no process group. ``provider``: the
        model's provider (default: ``to_megatron_provider(load_weights=False)``), which says whether
        it ties. Reads the two tensors only when the model ties and both are stored."""
        path = Path(hf_path) if hf_path is not None else self._checkpoint_path()
        provider = provider if provider is not None else self.to_megatron_provider(load_weights=False)
        check_tied_output(self._model_bridge, provider, HFCheckpoint.open(path))

    def _hf_config(self) -> Any:
        return (
            getattr(self.hf_pretrained, "config", None) or self.hf_pretrained
        )  # from_hf_config keeps the config itself

    def _checkpoint_path(self) -> Path:
        path = getattr(self.hf_pretrained, "model_name_or_path", None)
        if path is None or not Path(path).is_dir():
            raise ValueError(
                "this bridge was not created from a local checkpoint directory: pass hf_path= to load_hf_shards"
            )
        return Path(path)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Route:
    """How one export runs: the plan's ``exporter`` (yielding ``names``, None: all), or the stock
    path for ``reason``."""

    exporter: PlanExporter | None = None
    names: frozenset[str] | None = None
    reason: str | None = None
    lora: AdapterExport | None = None  # the model's adapters, merged into what the exporter yields


class _NoExportWork:
    """The export stream of a rank with no part in a replica's export: empty, no collective to guard."""

    def __iter__(self) -> "_NoExportWork":
        return self

    def __next__(self) -> Any:
        raise StopIteration


def _still_open(last: CollectiveCall, what: str) -> str:
    """Why ``what`` is refused while ``last``, an export of this process (this bridge's or another's), is still open."""
    return (
        f"{what} was called while {last.what} (call #{last.number}, of this bridge or another) is still open "
        "(neither iterated to its end nor closed): two exports in flight pair their gathers with the wrong partners. "
        "Finish or close the first export on every rank before starting another: iterate it to the end, or call "
        "close() on it (a generator kept alive, by a variable or an exception's traceback, stays open; closing one "
        "runs the rest of its export, which its peers' close or iteration completes)"
    )


def _chunks(model: list[torch.nn.Module] | torch.nn.Module) -> list[torch.nn.Module]:
    return model if isinstance(model, list) else [model]


def _with_current_params(tasks: list, params: dict[str, torch.Tensor], replaced: frozenset[str]) -> list:
    """The bridge's conversion tasks with the parameters the model holds now where it replaced
    them (what a caller's tasks are compared with, ``plan.task_selection``)."""
    return [
        dataclasses.replace(task, param_weight=params[task.global_param_name])
        if task is not None and task.global_param_name in replaced
        else task
        for task in tasks
    ]


def _unwrapped(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunks)


def _selected(only: frozenset[str] | None, names: frozenset[str] | None, plan: ExportPlan) -> frozenset[str] | None:
    """What an export yields given ``only`` and the names of its conversion tasks (None: no limit);
    names of ``only`` outside the plan stay, for the exporter to refuse."""
    if only is None or names is None:
        return only if names is None else names
    return (only & names) | (only - {e.hf_name for e in plan.entries})


def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, PlanError) else f"{type(err).__name__}: {err}"


def _only(stream: Iterable[tuple[str, torch.Tensor]], names: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in stream if name in names)


def _rewrapped(state: _ModelState) -> bool:
    """Whether a state not yet planned may describe the model before it changed shape: modules or
    parameters were registered since it was made (a PEFT wrap after ``load_hf_shards``, whose
    model bridge cached the names before the wrap). Planning has not started, so a fresh state is
    the same on every rank's next (collective) call."""
    return state.plan is None and state.plan_error is None and state.registrations != registration_count()


def _same_chunks(refs: tuple[weakref.ref, ...], chunks: list[torch.nn.Module]) -> bool:
    return len(refs) == len(chunks) and all(ref() is chunk for ref, chunk in zip(refs, chunks))


def _drop_state(bridge_ref: weakref.ref, state_ref: weakref.ref) -> None:
    """The model of ``state_ref`` was garbage-collected: its bridge lets go of the state (and with
    it the parameters it read), unless it moved on to another model already."""
    bridge, state = bridge_ref(), state_ref()
    if bridge is not None and state is not None and bridge._model_state is state:
        bridge._model_state = None


def _flat(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket


def _on_cpu(buckets: Iterable[list[tuple[str, Any]]], cpu: bool) -> Iterable[list[tuple[str, Any]]]:
    if not cpu:
        return buckets
    return ([(name, tensor.cpu()) for name, tensor in bucket] for bucket in buckets)


def _in_lists(
    stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stock export's stream cut into lists of up to ``bucket_bytes`` (its tensors are fresh
    allocations or the parameters themselves, valid after the stream advances)."""
    bucket, size = [], 0
    for name, tensor in stream:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class _StockArguments(NamedTuple):
    """The arguments stock's export takes (``AutoBridge.export_hf_weights``'), in its order: what
    the plan's route is decided on, and what the stock path is called with."""

    cpu: bool = False
    show_progress: bool = True
    conversion_tasks: list | None = None
    merge_adapter_weights: bool = True
    weight_dtype: torch.dtype | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class _ExportOptions:
    """The arguments of one export call (``export_hf_weights`` / ``export_hf_weight_buckets``):
    stock's, and the ones this bridge adds."""

    stock: _StockArguments
    reuse_buffer_from_cache: bool = False
    hold_outputs: bool = False
    fp8: BlockwiseFP8Config | str | None = None
    replica: int | None = None
    only: frozenset[str] | None = None  # passed as any collection of names

    def __post_init__(self) -> None:
        if self.only is not None:
            object.__setattr__(self, "only", frozenset(self.only))
