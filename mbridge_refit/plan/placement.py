"""Where the pieces of each HF tensor sit inside a rank's local Megatron parameter.

A local Megatron shard is a concatenation, along one dimension, of contiguous slices of one or
more HF tensors. Examples for tensor-parallel rank ``r`` of ``t``:

* column-parallel ``o = W x`` weight: rows ``[r*n/t, (r+1)*n/t)`` of the HF tensor;
* row-parallel weight: columns ``[r*n/t, (r+1)*n/t)`` (a row-parallel bias is whole);
* replicated (norms, routers): the whole HF tensor;
* gated MLP ``linear_fc1``: this rank's rows of ``gate`` followed by its rows of ``up``;
* fused QKV with grouped-query heads: for each query group this rank owns, the group's query
  heads, then its key head, then its value head (Megatron's interleaved layout).

``SliceCopy`` records one such piece exactly. The rules are a table keyed by the bridge's
mapping class (``placement_rules``), then a table keyed by placement kind (``SLICE_RULES``);
a mapping class without a rule is reported by name.
The same description drives the CPU loader (each rank reads only its slices from disk) and the
export plan's source layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch


class PlacementError(ValueError):
    """A parameter whose mapping or shape has no exact slice description."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SliceCopy:
    """HF tensor ``hf_name`` [hf_start:hf_stop] along ``dim`` == local param [local_start:+len] along ``dim``."""

    hf_name: str
    dim: int
    hf_start: int
    hf_stop: int
    local_start: int

    @property
    def length(self) -> int:
        return self.hf_stop - self.hf_start

    def read(self, source: Any) -> torch.Tensor:
        """Read this slice from a safetensors ``get_slice`` handle (only these bytes are read)."""
        if self.dim == 0:
            return source[self.hf_start : self.hf_stop]
        return source[:, self.hf_start : self.hf_stop]


class ShardContext(NamedTuple):
    """What a rule needs to place one parameter: its local shape, TP coordinates and config."""

    local_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int
    config: Any


def _even_split(total_local: int, rank: int) -> tuple[int, int]:
    return rank * total_local, (rank + 1) * total_local


def place_column(hf_name: str, ctx: ShardContext) -> list[SliceCopy]:
    rows = ctx.local_shape[0]
    start, stop = _even_split(rows, ctx.tp_rank)
    return [SliceCopy(hf_name=hf_name, dim=0, hf_start=start, hf_stop=stop, local_start=0)]


def place_row(hf_name: str, ctx: ShardContext) -> list[SliceCopy]:
    if len(ctx.local_shape) == 1:  # a row-parallel bias is whole on every rank
        return place_replicated(hf_name, ctx)
    cols = ctx.local_shape[1]
    start, stop = _even_split(cols, ctx.tp_rank)
    return [SliceCopy(hf_name=hf_name, dim=1, hf_start=start, hf_stop=stop, local_start=0)]


def place_replicated(hf_name: str, ctx: ShardContext) -> list[SliceCopy]:
    return [SliceCopy(hf_name=hf_name, dim=0, hf_start=0, hf_stop=ctx.local_shape[0], local_start=0)]


def place_gated(gate: str, up: str, ctx: ShardContext) -> list[SliceCopy]:
    local_rows = ctx.local_shape[0]
    if local_rows % 2:
        raise PlacementError(f"gated MLP shard has an odd number of rows ({local_rows})")
    half = local_rows // 2
    start, stop = _even_split(half, ctx.tp_rank)
    return [
        SliceCopy(hf_name=gate, dim=0, hf_start=start, hf_stop=stop, local_start=0),
        SliceCopy(hf_name=up, dim=0, hf_start=start, hf_stop=stop, local_start=half),
    ]


def place_qkv(q: str, k: str, v: str, ctx: ShardContext) -> list[SliceCopy]:
    config = ctx.config
    if getattr(config, "attention_output_gate", False):
        raise PlacementError("QKV with attention_output_gate has no slice description yet")
    heads, groups = config.num_attention_heads, config.num_query_groups
    head_dim = config.kv_channels or config.hidden_size // heads
    if groups % ctx.tp_size:
        raise PlacementError(
            f"num_query_groups={groups} is not divisible by tp={ctx.tp_size}: replicated KV heads are not supported"
        )
    heads_per_group = heads // groups
    local_groups = groups // ctx.tp_size
    copies, local = [], 0
    for group in range(ctx.tp_rank * local_groups, (ctx.tp_rank + 1) * local_groups):
        q_rows = heads_per_group * head_dim
        for name, start, length in (
            (q, group * q_rows, q_rows),
            (k, group * head_dim, head_dim),
            (v, group * head_dim, head_dim),
        ):
            copies.append(SliceCopy(hf_name=name, dim=0, hf_start=start, hf_stop=start + length, local_start=local))
            local += length
    if local != ctx.local_shape[0]:
        raise PlacementError(f"QKV slices cover {local} rows but the local shard has {ctx.local_shape[0]}")
    return copies


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementKind:
    """How one Megatron parameter is built from HF tensors: a rule name and its HF tensor names.

    Small and picklable: the rank that owns a parameter computes it (it needs the module to
    tell column from row parallel) and sends it to ranks that do not own the parameter.
    """

    kind: str  # "column" | "row" | "replicated" | "gated" | "qkv"
    hf_names: tuple[str, ...]


def _slices_single(rule: Callable[[str, ShardContext], list[SliceCopy]]):
    return lambda names, ctx: rule(names[0], ctx)


SLICE_RULES: dict[str, Callable[[tuple[str, ...], ShardContext], list[SliceCopy]]] = {
    "column": _slices_single(place_column),
    "row": _slices_single(place_row),
    "replicated": _slices_single(place_replicated),
    "gated": lambda names, ctx: place_gated(*names, ctx),
    "qkv": lambda names, ctx: place_qkv(*names, ctx),
}


def _auto_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    if getattr(mapping, "permute_dims", None) is not None:
        raise PlacementError(f"AutoMapping with permute_dims={mapping.permute_dims} has no slice description")
    return PlacementKind(kind=_detected_kind(mapping, module), hf_names=(mapping.hf_param,))


_DETECTED: dict[tuple, str] = {}


def _detected_kind(mapping: Any, module: torch.nn.Module) -> str:
    """The bridge's own column/row/replicated detection, memoised on everything it reads.

    (Upstream retries an optional import on every call: ~0.25 ms per parameter, seconds for a MoE.)
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


@functools.cache
def placement_rules() -> list[tuple[type, Callable[[Any, torch.nn.Module], PlacementKind]]]:
    """Mapping class -> how to name its placement. Most specific first: the first isinstance match wins."""
    from megatron.bridge.models.conversion import param_mapping as pm

    return [
        (pm.QKVMapping, lambda m, _: PlacementKind(kind="qkv", hf_names=(m.hf_param["q"], m.hf_param["k"], m.hf_param["v"]))),
        (pm.GatedMLPMapping, lambda m, _: PlacementKind(kind="gated", hf_names=(m.hf_param["gate"], m.hf_param["up"]))),
        (pm.ColumnParallelMapping, _fixed_kind("column")),
        (pm.RowParallelMapping, _fixed_kind("row")),
        (pm.ReplicatedMapping, _fixed_kind("replicated")),
        (pm.DirectMapping, _fixed_kind("replicated")),
        (pm.AutoMapping, _auto_kind),
    ]


def placement_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    """Name the placement of ``mapping``'s parameter (call on a rank that holds ``module``).

    Raises PlacementError naming the parameter when the mapping type has no rule.
    """
    if not getattr(mapping, "is_grouped_export", False):
        for mapping_type, rule in placement_rules():
            if isinstance(mapping, mapping_type):
                _check_no_custom_conversion(mapping, mapping_type)
                return rule(mapping, module)
    supported = ", ".join(t.__name__ for t, _ in placement_rules())
    raise PlacementError(
        f"parameter {mapping.megatron_param!r} uses {type(mapping).__name__}, which has no slice "
        f"description (supported: {supported})."
    )


def _check_no_custom_conversion(mapping: Any, mapping_type: type) -> None:
    """A subclass that overrides the export conversion may change data or shape (e.g. Ernie 4.5's
    expert bias, unsqueezed to [1, N] on export): the slice rules describe only the base class, so
    such a mapping is refused by name and the model falls back to the stock export."""
    if type(mapping).megatron_to_hf is not mapping_type.megatron_to_hf:
        raise PlacementError(
            f"parameter {mapping.megatron_param!r} uses {type(mapping).__name__}, which overrides "
            f"{mapping_type.__name__}.megatron_to_hf (a conversion the slice rules cannot describe)"
        )


def slices_for(kind: PlacementKind, ctx: ShardContext) -> list[SliceCopy]:
    """The HF slices making up the local shard described by ``ctx`` (pure: any rank can ask)."""
    return SLICE_RULES[kind.kind](kind.hf_names, ctx)


def slice_copies(mapping: Any, module: torch.nn.Module, param: torch.Tensor, config: Any) -> list[SliceCopy]:
    """The exact HF slices that make up ``param`` (this rank's shard); they tile it exactly (checked)."""
    ctx = ShardContext(local_shape=tuple(param.shape), tp_rank=mapping.tp_rank, tp_size=mapping.tp_size, config=config)
    copies = slices_for(placement_kind(mapping, module), ctx)
    check_tiling(mapping.megatron_param, tuple(param.shape), copies)
    return copies


def hf_extents(kind: PlacementKind, ctx: ShardContext) -> dict[str, tuple[int, int]]:
    """HF name -> (split dimension, the HF tensor's full extent along it), from the slices every
    tensor-parallel rank holds (pure: what the model needs the checkpoint tensor to be)."""
    extents: dict[str, tuple[int, int]] = {}
    for rank in range(ctx.tp_size):
        for copy in slices_for(kind, ctx._replace(tp_rank=rank)):
            dim, extent = extents.get(copy.hf_name, (copy.dim, 0))
            extents[copy.hf_name] = (dim, max(extent, copy.hf_stop))
    return extents


def check_tiling(where: str, local_shape: tuple[int, ...], copies: list[SliceCopy]) -> None:
    """Raise unless ``copies`` cover the local shard exactly once along a single dimension."""
    dims = {c.dim for c in copies}
    if len(dims) != 1:
        raise PlacementError(f"{where}: slices along several dimensions {sorted(dims)}")
    (dim,) = dims
    covered = sorted((c.local_start, c.local_start + c.length) for c in copies)
    cursor = 0
    for start, stop in covered:
        if start != cursor:
            raise PlacementError(f"{where}: slices leave a gap or overlap at {cursor}")
        cursor = stop
    if len(local_shape) <= dim or cursor != local_shape[dim]:
        raise PlacementError(
            f"{where}: slices cover {cursor} along dim {dim}, local shard shape is {local_shape}"
        )
