"""LoRA adapters in the export plan: which HF tensors an adapter changes, and where its factors live.

Megatron-Bridge's PEFT (``megatron.bridge.peft.lora.LoRA`` applied to the model chunks) wraps a
linear layer as ``LoRALinear``: the base linear becomes ``to_wrap`` (its weight's global name
``...linear_qkv.to_wrap.weight``, mapped as before) and ``adapter`` holds ``linear_in`` (A,
[r, in]) and ``linear_out`` (B, [out, r]), each split over the tensor-parallel group like the
base layer's input or output. Stock's merged export yields ``base + alpha/r · B·A`` for every HF
tensor of an adapted weight; its adapter export yields A and B per HF base name (q, k and v of a
fused QKV each get the whole A and their rows of B; gate and up likewise).

Here the factors are planned as entries of their own, with the slice rules of base weights
(``plan.build.plan_entries``): A is placed as stock gathers ``linear_in`` (column or row
parallel, by the mapping class stock picks for it), B as its base weight is placed
(``FACTOR_KINDS``: B of a fused QKV is split into q, k, v rows like the QKV weight, B of a gated
MLP into gate and up), with r columns. ``AdapterTarget`` names, per adapted HF tensor, the
entries holding its A and B and its scale. Building is collective (stock's adapter tasks: one
object gather over the pipeline group, cached by the model bridge; one object gather of every
rank's factor specs here).

What is not planned is refused by name (``PlanError``, every rank alike): CanonicalLoRA's
per-projection adapters, adapters of grouped experts, expert adapters at expert-parallel or
expert tensor-parallel size above 1 (Megatron-Bridge 0.6.2 names an expert's adapter by its
local expert number, so stock merges rank 0's adapter into every rank's experts: its output
differs between ranks and there is no exact reference), and adapted layers whose placement has
no factor rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_refit.plan.build import ParallelSizes, ParamSpec, exchange_contributions, plan_entries
from mbridge_refit.plan.entries import ExportPlan, PlanError
from mbridge_refit.plan.placement import placement_kind
from mbridge_refit.plan.slices import PlacementKind

__all__ = [
    "FACTOR_KINDS",
    "WRAPPED_MARKER",
    "AdapterTarget",
    "LoraPlan",
    "adapted_params",
    "build_lora_plan",
    "lora_name",
]

# Megatron-Bridge's LoRALinear keeps the base linear as ``to_wrap`` (its weight ``....to_wrap.weight``).
WRAPPED_MARKER = ".to_wrap."

# Base weight's placement kind -> how its adapter's B is placed (B has the base's output rows).
# A row-parallel base splits its input: its B ([out, r]) is column-parallel.
FACTOR_KINDS: dict[str, str] = {
    "qkv": "qkv",
    "gated": "gated",
    "column": "column",
    "row": "column",
    "replicated": "replicated",
}

# The mapping class stock gathers ``linear_in`` with -> A's placement kind.
_A_KINDS: dict[str, str] = {
    "ColumnParallelMapping": "column",
    "RowParallelMapping": "row",
    "ReplicatedMapping": "replicated",
}

# PEFT's checkpoint names: the base weight's ``.weight`` replaced (Megatron-Bridge's MEGATRON_TO_HF_LORA_SUFFIX).
_FACTOR_SUFFIX = {"A": ".lora_A.weight", "B": ".lora_B.weight"}


def lora_name(base: str, factor: str) -> str:
    """The PEFT name of ``factor`` ("A" or "B") of the adapter on HF weight ``base``."""
    stem = base.removesuffix(".weight")
    return stem + _FACTOR_SUFFIX[factor]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterTarget:
    """One HF tensor an adapter changes: ``base + scale · B·A`` with ``scale = alpha / dim``."""

    base: str  # the HF name of the base weight
    lora_a: str  # PEFT names of its factors
    lora_b: str
    a_entry: str  # the plan entry holding A (the first target's lora_a for a fused module)
    adapter: str  # the global Megatron prefix of the adapted module
    alpha: float
    dim: int

    @property
    def scale(self) -> float:
        return self.alpha / self.dim  # stock's LoRAMerge: a Python float


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraPlan:
    """The factor entries of every adapter and the HF tensors they change, in stock's adapter-export order."""

    plan: ExportPlan  # one entry per A (per adapter) and per B (per base HF name)
    targets: tuple[AdapterTarget, ...]

    def by_base(self) -> dict[str, AdapterTarget]:
        return {t.base: t for t in self.targets}

    def facts(self) -> dict[str, Any]:
        """What an HF PEFT ``adapter_config.json`` says of these adapters: ``r`` and ``lora_alpha``
        (the most common, with per-module patterns where others differ) and ``target_modules``
        (the module names of the base weights, as Megatron-Bridge infers them)."""
        ranks = {t.base.removesuffix(".weight"): t.dim for t in self.targets}
        alphas = {t.base.removesuffix(".weight"): t.alpha for t in self.targets}
        r = max(set(ranks.values()), key=list(ranks.values()).count)
        alpha = max(set(alphas.values()), key=list(alphas.values()).count)
        return {
            "r": r,
            "lora_alpha": alpha,
            "target_modules": sorted({name.rsplit(".", 1)[-1] for name in ranks}),
            "rank_pattern": {name: rank for name, rank in ranks.items() if rank != r},
            "alpha_pattern": {name: a for name, a in alphas.items() if a != alpha},
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class _Contribution:
    """What one rank knows of the adapters it holds; exchanged with every rank of the model."""

    specs: tuple[ParamSpec, ...]
    targets: tuple[AdapterTarget, ...]
    errors: tuple[str, ...]


def adapted_params(plan: ExportPlan) -> frozenset[str]:
    """The base weights of ``plan`` that an adapter wraps (the same on every rank: read from the plan)."""
    return frozenset(e.megatron_param for e in plan.entries if WRAPPED_MARKER in e.megatron_param)


def build_lora_plan(
    model_bridge: Any,
    chunks: list[torch.nn.Module],
    base: ExportPlan,
    base_tasks: list,
    sizes: ParallelSizes,
    group: Any = None,
) -> tuple[LoraPlan, dict[str, torch.Tensor], list]:
    """The factor plan of the adapters of ``chunks`` (unwrapped), this rank's factor parameters
    by global name, and the factor tasks that hold them (for ``runtime.live_params``). Collective
    over the pipeline group (stock's adapter tasks) and ``group`` (the whole job by default).
    Raises ``PlanError`` on every rank alike for adapters it does not plan."""
    try:
        by_base = model_bridge.build_adapter_conversion_tasks(chunks)
        order = list(by_base)
        mine, params, tasks = _rank_contribution(by_base, base_tasks, sizes)
    except PlanError as err:
        order, mine, params, tasks = [], _Contribution(specs=(), targets=(), errors=(str(err),)), {}, []
    except Exception as err:  # still take part in the exchange, so every rank learns of it
        order, params, tasks = [], {}, []
        mine = _Contribution(specs=(), targets=(), errors=(f"{type(err).__name__}: {err}",))
    gathered = exchange_contributions(mine, group)
    errors = sorted({e for c in gathered for e in c.errors})
    if errors:
        raise PlanError("LoRA adapters: " + "; ".join(errors[:5]))
    specs = {s.global_name: s for c in gathered for s in c.specs}
    targets: dict[str, dict[str, AdapterTarget]] = {}  # adapter -> base -> target (replicas describe the same)
    for c in gathered:
        for t in c.targets:
            targets.setdefault(t.adapter, {}).setdefault(t.base, t)
    missing = sorted(set(order) ^ set(targets))
    if missing:
        raise PlanError(f"LoRA adapters: no rank describes the adapters of {missing[:3]}")
    entries = plan_entries(specs, sizes, chunks[0].config)
    plan = dataclasses.replace(base, entries=tuple(entries))
    return LoraPlan(plan=plan, targets=tuple(t for prefix in order for t in targets[prefix].values())), params, tasks


def _rank_contribution(by_base: dict[str, list], base_tasks: list, sizes: ParallelSizes):
    """This rank's factor specs and targets, from stock's adapter tasks (metadata only)."""
    from megatron.bridge.peft.utils import is_expert_linear
    from megatron.core import parallel_state as ps

    tasks_by_name = {t.global_param_name: t for t in base_tasks if t is not None}
    specs, targets, params, factor_tasks = [], [], {}, []
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for prefix, adapters in by_base.items():
        if len(adapters) != 1 or adapters[0].adapter_key is not None:
            keys = [a.adapter_key for a in adapters]
            raise PlanError(
                f"{prefix} has per-projection adapters {keys} (CanonicalLoRA), which the plan does not merge"
            )
        adapter = adapters[0]
        if adapter.requires_expert_splits or adapter.linear_in_task.param_weight is None:
            if adapter.requires_expert_splits:
                raise PlanError(f"{prefix}: adapters of grouped experts are not planned")
            continue  # another pipeline stage's adapter
        expert = is_expert_linear(prefix)  # stock's own test, as its merge decides
        if expert and (sizes.ep > 1 or sizes.etp > 1):
            raise PlanError(
                f"{prefix}: expert adapters at ep={sizes.ep}, etp={sizes.etp} (Megatron-Bridge names them by local "
                "expert number, so stock merges one rank's adapter into other ranks' experts; no exact reference)"
            )
        base_task = tasks_by_name.get(prefix + WRAPPED_MARKER + "weight")
        if base_task is None or bool(base_task.mapping.is_expert) != expert:
            raise PlanError(
                f"{prefix}: the adapted layer's weight {prefix}.to_wrap.weight has no matching conversion task"
            )
        base_kind = placement_kind(base_task.mapping, base_task.megatron_module)
        a_spec, b_spec, mine = _factor_specs(adapter, base_kind, expert, pp_rank)
        specs += [a_spec, b_spec]
        targets += mine
        for task in (adapter.linear_in_task, adapter.linear_out_task):
            params[task.global_param_name] = task.param_weight
            factor_tasks.append(task)
    return _Contribution(specs=tuple(specs), targets=tuple(targets), errors=()), params, factor_tasks


def _factor_specs(adapter: Any, base_kind: PlacementKind, expert: bool, pp_rank: int):
    """The ``ParamSpec`` of ``linear_in`` (A) and ``linear_out`` (B) and the adapter's targets."""
    prefix = adapter.global_base_prefix
    b_kind = FACTOR_KINDS.get(base_kind.kind)
    a_kind = _A_KINDS.get(type(adapter.linear_in_task.mapping).__name__)
    if b_kind is None or a_kind is None or base_kind.elementwise_op or base_kind.relayout:
        raise PlanError(
            f"{prefix}: an adapter on a {base_kind.kind!r} weight (A gathered by "
            f"{type(adapter.linear_in_task.mapping).__name__}) has no factor rule (supported: {sorted(FACTOR_KINDS)})"
        )
    if type(adapter.linear_out_task.mapping).__name__ == "ReplicatedMapping" and b_kind != "replicated":
        raise PlanError(f"{prefix}: stock keeps B of a {base_kind.kind!r} weight whole, which the plan does not place")
    bases = base_kind.hf_names
    a_names = tuple(lora_name(b, "A") for b in bases)
    b_names = tuple(lora_name(b, "B") for b in bases)
    specs = (
        ParamSpec.of_task(
            adapter.linear_in_task, PlacementKind(kind=a_kind, hf_names=a_names[:1]), pp_rank=pp_rank, expert=expert
        ),
        ParamSpec.of_task(
            adapter.linear_out_task,
            dataclasses.replace(base_kind, kind=b_kind, hf_names=b_names),
            pp_rank=pp_rank,
            expert=expert,
        ),
    )
    targets = tuple(
        AdapterTarget(
            base=b, lora_a=a, lora_b=bn, a_entry=a_names[0], adapter=prefix, alpha=adapter.alpha, dim=adapter.dim
        )
        for b, a, bn in zip(bases, a_names, b_names)
    )
    return *specs, targets
