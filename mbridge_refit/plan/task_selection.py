"""Which tensors of an export plan a caller's conversion tasks stand for.

Stock ``export_hf_weights(conversion_tasks=tasks)`` converts exactly ``tasks``, in their order.
RL frameworks pass them: NeMo-RL builds every task once (``get_conversion_tasks``, ``None``
dropped) and passes that list on every refit; a caller may pass a part of it (a chunk, a bucket).
``names_for_tasks`` maps such a list onto the plan: the HF names its tasks yield, when every task
is one the plan was built from (the same parameter tensor, module, stage and mapping, and no cast
or hook of its own) and the tasks keep the bridge's order, so that the plan's order of those names
is the order stock yields them in. Anything else raises ``TaskMismatch`` naming the first task
that differs, and the export runs the stock path with that reason.

Which names a task yields: its parameter's entries; an embedding's task also the tied output
weight; an expert's task on expert-parallel rank r (whose tasks name r's experts) every rank's
tensors of that local expert index; a stacked expert tensor (grouped export) comes with the last
of its experts, so a list holds all of its experts' tasks or none of them.

Pure: reads the tasks' attributes (never a tensor's data); no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mbridge_refit.errors import InputError
from mbridge_refit.plan.entries import ExportPlan, PlanEntry, with_expert_number

__all__ = ["TaskMismatch", "names_for_tasks"]


class TaskMismatch(InputError):
    """Conversion tasks the plan cannot run as stock would (the message names the task and why)."""


def names_for_tasks(given: Any, known: Sequence[Any], plan: ExportPlan, *, ep_rank: int) -> frozenset[str] | None:
    """The plan's HF names that ``given`` yields in stock's export; None when ``given`` is every
    task of ``known`` (the whole plan). ``known``: the tasks the plan was built from, on this rank
    (``build_conversion_tasks``, ``None`` where a parameter has no mapping). ``ep_rank``: this
    rank's expert-parallel rank. Raises ``TaskMismatch``."""
    if not isinstance(given, (list, tuple)):
        raise TaskMismatch(
            f"conversion_tasks is a {type(given).__name__}, not a list or tuple: the stock export reads it once, "
            "lazily, and the plan would have to read it ahead"
        )
    positions = {task.global_param_name: index for index, task in enumerate(known) if task is not None}
    order = [positions.get(getattr(task, "global_param_name", None), -1) for task in given]
    for index, (task, position) in enumerate(zip(given, order)):
        _check_task(index, task, known[position] if position >= 0 else None)
    if any(later <= earlier for earlier, later in zip(order, order[1:])):
        raise TaskMismatch(
            "conversion_tasks are not in the order of the bridge's tasks (or name a parameter twice): stock yields "
            "them in the given order, the plan in the bridge's"
        )
    if len(given) == len(positions):
        return None
    return _yielded_names(plan, [task.global_param_name for task in given], ep_rank)


def _check_task(index: int, task: Any, ref: Any) -> None:
    """``task`` (``conversion_tasks[index]``) is ``ref``, the bridge's task for its parameter, in
    everything the export reads."""
    where = f"conversion_tasks[{index}]"
    if task is None:
        raise TaskMismatch(f"{where} is None")
    if ref is None:
        raise TaskMismatch(
            f"{where} names {getattr(task, 'global_param_name', None)!r}, which this model's tasks do not "
            "(tasks of another model, of adapters, or not conversion tasks)"
        )
    name = ref.global_param_name
    if type(task) is not type(ref):
        raise TaskMismatch(f"{where} ({name}) is a {type(task).__name__}, not the bridge's {type(ref).__name__}")
    if task.param_weight is not ref.param_weight or task.megatron_module is not ref.megatron_module:
        raise TaskMismatch(
            f"{where} ({name}) carries another tensor or module than the model's parameter: stock exports the "
            "task's tensor, the plan reads the model's"
        )
    if (task.pp_rank, task.vp_stage) != (ref.pp_rank, ref.vp_stage):
        raise TaskMismatch(f"{where} ({name}) has another pipeline stage than the bridge's task")
    if not _same_mapping(task.mapping, ref.mapping):
        raise TaskMismatch(
            f"{where} ({name}) converts with {type(task.mapping).__name__} "
            f"{getattr(task.mapping, 'hf_param', None)!r}, the plan with {type(ref.mapping).__name__} "
            f"{getattr(ref.mapping, 'hf_param', None)!r}"
        )
    if getattr(task, "weight_dtype", None) != getattr(ref, "weight_dtype", None):
        raise TaskMismatch(f"{where} ({name}) casts to weight_dtype={task.weight_dtype}, which the plan does not")
    if getattr(task, "export_hook", None) is not getattr(ref, "export_hook", None):
        raise TaskMismatch(f"{where} ({name}) has an export_hook of its own, which the plan does not run")


def _same_mapping(a: Any, b: Any) -> bool:
    return type(a) is type(b) and all(
        getattr(a, attr, None) == getattr(b, attr, None) for attr in ("megatron_param", "hf_param")
    )


def _yielded_names(plan: ExportPlan, task_names: list[str], ep_rank: int) -> frozenset[str]:
    """The names the tasks ``task_names`` yield (see the module docstring)."""
    given = frozenset(task_names)
    per_rank = _experts_per_rank(plan)
    names: set[str] = set()
    for entry in plan.entries:
        if entry.sharding.stack is None:
            if _task_of(entry, ep_rank, per_rank) in given:
                names.add(entry.hf_name)
            continue
        experts = frozenset(_stacked_tasks(entry, plan.ep, ep_rank))
        if experts <= given:
            names.add(entry.hf_name)
        elif experts & given:
            raise TaskMismatch(
                f"conversion_tasks hold {len(experts & given)} of the {len(experts)} expert tasks of the stacked "
                f"tensor {entry.hf_name}: stock yields it only after all of them"
            )
    return frozenset(names)


def _task_of(entry: PlanEntry, ep_rank: int, experts_per_rank: int) -> str:
    """The global parameter name of this rank's task that yields ``entry`` (a tied output weight
    comes with the embedding, whose ``megatron_param`` it keeps)."""
    if not entry.is_expert:
        return entry.megatron_param
    return with_expert_number(entry.megatron_param, entry.sharding.local_expert_index + ep_rank * experts_per_rank)


def _stacked_tasks(entry: PlanEntry, ep: int, ep_rank: int) -> list[str]:
    """The global names of this rank's expert tasks of a stacked entry."""
    per_rank = entry.sharding.stack.num_experts // ep
    return [with_expert_number(entry.megatron_param, ep_rank * per_rank + k) for k in range(per_rank)]


def _experts_per_rank(plan: ExportPlan) -> int:
    indices = {e.sharding.local_expert_index for e in plan.entries if e.is_expert and e.sharding.stack is None}
    return max(indices) + 1 if indices else 1
