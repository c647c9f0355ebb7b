"""Which path a model with LoRA adapters exports by, and the adapters' export kept per model.

``ModelAdapters`` is what the bridge keeps of one planned model's adapters: the base weights they
wrap (read from the plan), their ``runtime.lora.AdapterExport`` built on first use, the factor
parameters kept current (``runtime.live_params``), or the ``PlanError`` of adapters the plan does
not describe (the same on every rank; kept, never retried). The routes decide on those verdicts,
the same on every rank: ``merge_route`` (``export_hf_weights``: the plan with the adapters merged,
or the stock path with the reason), ``adapter_export_route`` (``export_adapter_weights``: the
adapters' plan, or stock's adapter export with the reason); ``refuse_adapters`` refuses paths that
read the parameters as they are. ``RefitBridge`` is the facade; each route takes its ``adapters``,
a call that returns the model's ``AdapterExport`` (None: no adapters) or raises ``PlanError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from mbridge_refit.plan.build import current_sizes
from mbridge_refit.plan.entries import ExportPlan, PlanError
from mbridge_refit.plan.lora import adapted_params, build_lora_plan
from mbridge_refit.runtime.live_params import LiveParams
from mbridge_refit.runtime.lora import AdapterExport

__all__ = ["ModelAdapters", "adapter_export_route", "adapter_tuples", "merge_route", "refuse_adapters"]

Adapters = Callable[[], AdapterExport | None]  # the model's adapter export (None: none); raises PlanError


@dataclass(kw_only=True, slots=True)
class ModelAdapters:
    """The LoRA adapters of one planned model (module docstring); made once per plan."""

    adapted: frozenset[str]  # the plan's base weights that LoRA adapters wrap
    export: AdapterExport | None = None  # their export (``plan.lora``), built on first use
    live: LiveParams | None = None  # their factor parameters, kept current
    error: PlanError | None = None  # why they have no plan (every rank alike; never retried)

    @classmethod
    def of(cls, plan: ExportPlan) -> "ModelAdapters":
        return cls(adapted=adapted_params(plan))

    def built(
        self,
        model_bridge: Any,
        chunks: list[torch.nn.Module],
        plan: ExportPlan,
        tasks: list,
        group: Any,
        device: torch.device,
    ) -> AdapterExport | None:
        """The export of the adapters of ``chunks`` (the model's chunks, wrapped or not, whose plan and
        conversion tasks are ``plan`` and ``tasks``), None for a model without any. Collective on the
        first call (over ``group``, the ranks the plan was built over); raises ``PlanError`` on every
        rank alike for adapters the plan does not describe (kept: never retried)."""
        if not self.adapted:
            return None
        if self.error is not None:
            raise self.error
        if self.export is None:
            from megatron.core.utils import unwrap_model

            unwrapped = unwrap_model(chunks)
            try:
                lora, _, factor_tasks = build_lora_plan(
                    model_bridge, unwrapped, plan, tasks, current_sizes(unwrapped), group
                )
            except PlanError as err:
                self.error = err
                raise
            self.live = LiveParams(unwrapped, factor_tasks)
            self.export = AdapterExport(lora, self.live.params, device)
        return self.export

    def refresh(self) -> None:
        """Swap in the factor parameters the model holds now, where it replaced them."""
        if self.live is not None:
            self.live.refresh()

    def check_in_place(self) -> None:
        """Raise ``ModelChangedError`` naming a factor parameter changed in place (``LiveParams.check_in_place``)."""
        if self.live is not None:
            self.live.check_in_place()

    def release(self) -> None:
        """Free the factors' held buffers and the views of parameters their exporter keeps."""
        if self.export is not None:
            self.export.held.release()
            self.export.exporter.release_views()


def merge_route(adapters: Adapters, merge: bool) -> tuple[AdapterExport | None, str | None]:
    """``(the adapters' export, None)`` for the plan (None: the model has no adapters), or
    ``(None, why the stock path runs)``; the same on every rank (the plan's verdicts are)."""
    try:
        lora = adapters()
    except PlanError as err:
        return None, f"no merge plan for this model's LoRA adapters: {err}"
    if lora is not None and not merge:
        return None, (
            "merge_adapter_weights=False: stock yields adapted weights unmerged under '...base_layer.weight' "
            "names, which the plan does not"
        )
    return lora, None


def adapter_export_route(
    adapters: Adapters, exclude_adapter_base_prefixes: Iterable[str] | None
) -> tuple[AdapterExport | None, str | None]:
    """How ``export_adapter_weights`` runs: ``(the adapters' export, None)`` from their plan, or
    ``(None, why stock's adapter export runs)``: the prefixes are passed, the model has no adapters,
    or they have no plan. The same on every rank."""
    if exclude_adapter_base_prefixes is not None:
        return None, "exclude_adapter_base_prefixes is passed"
    lora, reason = merge_route(adapters, merge=True)
    if lora is None and reason is None:
        reason = "the model has no LoRA adapters"
    return lora, reason


def refuse_adapters(plan: ExportPlan, what: str) -> None:
    """Raise ``PlanError`` where ``what``, which reads the parameters themselves, would skip the
    merge of the LoRA adapters that ``plan``'s weights carry."""
    if adapted_params(plan):
        raise PlanError(
            f"{what} reads the parameters themselves; this model's LoRA adapters would not be merged "
            "(export_hf_weights merges them)"
        )


def adapter_tuples(stream: Iterable[tuple[str, torch.Tensor]], make: Any, *, cpu: bool, keep: bool) -> Iterator[Any]:
    """Stock's ``HFWeightTuple``s of the adapter stream: on the CPU if asked, copies if the caller keeps them."""
    for name, tensor in stream:
        moved = tensor.cpu() if cpu else tensor
        yield make(name, tensor.clone() if keep and moved is tensor else moved)
