"""Which placement each of the bridge's mapping classes has: the per-mapping tables.

``placement_rules`` maps a mapping class (most specific first) to how its parameter's
``PlacementKind`` is named (``plan.slices`` has the geometry of each kind); a mapping class
without a rule is reported by name. ``elementwise_op_rules`` and ``relayout_rules`` name the
mapping classes that convert on top of their base class (``plan.conversions``); any other
override of a mapping's export conversion is refused (``_conversion_on_top``), so a model with
such a mapping falls back to the stock export.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from mbridge_refit.plan.slices import (
    AttentionHeads,
    PlacementError,
    PlacementKind,
    ShardContext,
    SliceCopy,
    check_tiling,
    slices_for,
)

__all__ = [
    "elementwise_op_rules",
    "passthrough_exports",
    "placement_kind",
    "placement_rules",
    "relayout_rules",
    "slice_copies",
]


def _auto_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    permute = getattr(mapping, "permute_dims", None)
    if permute is not None and tuple(permute) != (1, 0):
        raise PlacementError(f"AutoMapping with permute_dims={mapping.permute_dims} has no slice description")
    # AutoMapping.megatron_to_hf permutes the gathered tensor with permute_dims: (1, 0) is a transpose
    return PlacementKind(
        kind=_detected_kind(mapping, module),
        hf_names=(mapping.hf_param,),
        relayout=None if permute is None else "transpose",
    )


_DETECTED: dict[tuple, str] = {}


def _detected_kind(mapping: Any, module: torch.nn.Module) -> str:
    """The bridge's own column/row/replicated detection, memoised on everything it reads.

    (Upstream retries an optional import on every call: seconds over a MoE's parameters.)
    """
    key = (
        type(module),
        mapping.megatron_param.rsplit(".", 1)[-1],
        getattr(module, "tensor_model_parallel", None),
        getattr(module, "partition_dim", None),
        getattr(module, "parallel_mode", None),
    )
    kind = _DETECTED.get(key)
    if kind is None:
        kind = _DETECTED[key] = mapping._detect_parallelism_type(module)
    return kind


def _fixed_kind(kind: str) -> Callable[[Any, torch.nn.Module], PlacementKind]:
    return lambda mapping, module: PlacementKind(kind=kind, hf_names=(mapping.hf_param,))


def _qkv_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    """``qkv``, or ``qkv_gated`` when the layer has an attention output gate, with the layer's
    heads read from the module's config (the config the bridge's split reads)."""
    heads = AttentionHeads.of_module(module)
    names = (mapping.hf_param["q"], mapping.hf_param["k"], mapping.hf_param["v"])
    return PlacementKind(kind="qkv_gated" if heads.attention_output_gate else "qkv", hf_names=names, heads=heads)


def _concatenated_qkv_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    return PlacementKind(
        kind="qkv_concatenated", hf_names=(str(mapping.hf_param),), heads=AttentionHeads.of_module(module)
    )


def _full_dim_qk_norm_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    """MiniMax-M2's norm over all query (key) heads at once (``_FullDimQKNormMapping``): each rank
    holds the rows of its own heads, so column-parallel, unless the module's ``global_dim`` says
    ranks share heads (fewer KV heads than tensor-parallel ranks), which the plan refuses as for QKV."""
    local, global_dim = module.weight.shape[0], getattr(module, "global_dim", None)
    if global_dim is not None and global_dim != local * mapping.tp_size:
        raise PlacementError(
            f"a full-dimension QK norm of {global_dim} rows held as {local} rows on each of tp={mapping.tp_size} ranks: "
            "replicated KV heads are not supported"
        )
    return PlacementKind(kind="column", hf_names=(str(mapping.hf_param),))


def _family_rules() -> list[tuple[type, Callable[[Any, torch.nn.Module], PlacementKind]]]:
    """Rules for mapping classes a model family's bridge defines for itself."""
    from megatron.bridge.models.minimax_m2.minimax_m2_bridge import (
        _FullDimQKNormMapping,
    )

    return [(_FullDimQKNormMapping, _full_dim_qk_norm_kind)]


@functools.cache
def placement_rules() -> list[tuple[type, Callable[[Any, torch.nn.Module], PlacementKind]]]:
    """Mapping class -> how to name its placement. Most specific first: the first isinstance match wins."""
    from megatron.bridge.models.conversion import param_mapping as pm

    return [
        *_family_rules(),
        (pm.QKVMapping, _qkv_kind),
        (pm.ConcatenatedQKVMapping, _concatenated_qkv_kind),
        (
            pm.GDNLinearMapping,
            lambda m, _: PlacementKind(kind="gdn_in_proj", hf_names=(m.hf_param["qkvz"], m.hf_param["ba"])),
        ),
        (
            pm.GDNLinearMappingSeparate,
            lambda m, _: PlacementKind(
                kind="gdn_in_proj_separate", hf_names=tuple(m.hf_param[c] for c in ("qkv", "z", "b", "a"))
            ),
        ),
        (pm.GDNConv1dMapping, _fixed_kind("gdn_conv1d")),
        (pm.MambaInProjMapping, _fixed_kind("mamba_in_proj")),
        (pm.MambaConv1dMapping, _fixed_kind("mamba_conv1d")),
        (pm.GatedMLPMapping, lambda m, _: PlacementKind(kind="gated", hf_names=(m.hf_param["gate"], m.hf_param["up"]))),
        (pm.ColumnParallelMapping, _fixed_kind("column")),
        (pm.RowParallelMapping, _fixed_kind("row")),
        (pm.ReplicatedMapping, _fixed_kind("replicated")),
        (pm.DirectMapping, _fixed_kind("replicated")),
        (pm.AutoMapping, _auto_kind),
    ]


@functools.cache
def relayout_rules() -> dict[type, str]:
    """Mapping class -> the relayout its ``megatron_to_hf`` applies to its base class's result
    (exact classes). ``AutoMapping``'s ``permute_dims`` is read from the mapping itself."""
    from megatron.bridge.models.ernie.ernie_45_bridge import _SqueezeBiasMapping

    return {_SqueezeBiasMapping: "unsqueeze0"}


@functools.cache
def elementwise_op_rules() -> dict[type, str]:
    """Mapping class -> the op its ``megatron_to_hf`` applies to its base class's result (exact
    classes only: a subclass may convert differently and is refused like any other override)."""
    from megatron.bridge.models.conversion import param_mapping as pm

    return {pm.RMSNorm2ZeroCenteredRMSNormMapping: "add_one"}


def placement_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    """Name the placement of ``mapping``'s parameter (call on a rank that holds ``module``).

    Raises PlacementError naming the parameter when the mapping type has no rule.
    """
    if not getattr(mapping, "is_grouped_export", False):
        for mapping_type, rule in placement_rules():
            if isinstance(mapping, mapping_type):
                op, relayout = _conversion_on_top(mapping, mapping_type)
                kind = rule(mapping, module)
                if op is not None:
                    kind = dataclasses.replace(kind, elementwise_op=op)
                if relayout is not None:
                    kind = dataclasses.replace(kind, relayout=relayout)
                return kind
    supported = ", ".join(t.__name__ for t, _ in placement_rules())
    raise PlacementError(
        f"parameter {mapping.megatron_param!r} uses {type(mapping).__name__}, which has no slice "
        f"description (supported: {supported})."
    )


@functools.cache
def passthrough_exports() -> frozenset[Callable]:
    """``megatron_to_hf`` overrides that return their base class's result unchanged for every
    parameter a rank holds (the only ones the plan places): Ernie 4.5's ``_PPSafeMixin`` only
    turns the error of a parameter no pipeline stage holds (a dense layer's router) into ``{}``."""
    from megatron.bridge.models.ernie.ernie_45_bridge import _PPSafeMixin

    return frozenset({_PPSafeMixin.megatron_to_hf})


def _effective_export(cls: type) -> Callable:
    """The ``megatron_to_hf`` that decides ``cls``'s output: the first in its MRO that is not a passthrough."""
    for klass in cls.__mro__:
        own = klass.__dict__.get("megatron_to_hf")
        if own is not None and own not in passthrough_exports():
            return own
    return cls.megatron_to_hf


def _conversion_on_top(mapping: Any, mapping_type: type) -> tuple[str | None, str | None]:
    """``(elementwise op, relayout)`` a mapping applies on top of ``mapping_type``'s conversion:
    ``(None, None)`` for one that exports as ``mapping_type`` does; the op of a class of
    ``elementwise_op_rules``, or the relayout of a class of ``relayout_rules``, whose base class
    exports as ``mapping_type`` does (its base's slices, then the op or the relayout).

    Any other subclass that overrides the export conversion may change data or shape in ways the
    slice rules do not describe: such a mapping is refused by name and the model falls back to
    the stock export."""
    cls = type(mapping)
    if _effective_export(cls) is mapping_type.megatron_to_hf:
        return None, None
    over_base = _effective_export(cls.__base__) is mapping_type.megatron_to_hf
    op, relayout = elementwise_op_rules().get(cls), relayout_rules().get(cls)
    if over_base and (op is not None or relayout is not None):
        return op, relayout
    raise PlacementError(
        f"parameter {mapping.megatron_param!r} uses {type(mapping).__name__}, which overrides "
        f"{mapping_type.__name__}.megatron_to_hf (a conversion the slice rules cannot describe)"
    )


def slice_copies(mapping: Any, module: torch.nn.Module, param: torch.Tensor, config: Any) -> list[SliceCopy]:
    """The exact HF slices that make up ``param`` (this rank's shard); they tile it exactly (checked)."""
    ctx = ShardContext(local_shape=tuple(param.shape), tp_rank=mapping.tp_rank, tp_size=mapping.tp_size, config=config)
    copies = slices_for(placement_kind(mapping, module), ctx)
    check_tiling(mapping.megatron_param, tuple(param.shape), copies)
    return copies
