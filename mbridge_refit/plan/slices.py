"""Where the pieces of each HF tensor sit inside a rank's local Megatron parameter: slice geometry.

A local Megatron shard is a concatenation, along one dimension, of contiguous slices of one or
more HF tensors. Examples for tensor-parallel rank ``r`` of ``t``:

* column-parallel ``o = W x`` weight: rows ``[r*n/t, (r+1)*n/t)`` of the HF tensor;
* row-parallel weight: columns ``[r*n/t, (r+1)*n/t)`` (a row-parallel bias is whole);
* replicated (norms, routers): the whole HF tensor;
* gated MLP ``linear_fc1``: this rank's rows of ``gate`` followed by its rows of ``up``;
* fused QKV with grouped-query heads: for each query group this rank owns, the group's query
  heads, then its key head, then its value head (Megatron's interleaved layout); with an
  attention output gate, the group's gate heads follow its query heads (HF keeps each head's
  query and gate rows next to each other in ``q_proj``); the head counts and size are the
  layer's own (``AttentionHeads``: Gemma 4's full-attention layers differ from its sliding ones);
  against one concatenated HF ``qkv`` tensor (vision towers), the same pieces at the offsets of
  its q, k and v blocks;
* MiniMax-M2's full-dimension QK norm: this rank's heads' rows (column-parallel);
* gated delta net ``in_proj``: this rank's rows of each component (q, k, v, z, b, a) in turn,
  each component's rows interleaved per key head in HF's fused tensors (Qwen3-Next) or flat in
  separate ones (Qwen3.5); its ``conv1d``: this rank's rows of q, k, v;
* Mamba mixer ``in_proj``: this rank's rows of z, x, B, C and dt in turn, each stored flat in
  HF's ``in_proj``; its ``conv1d`` (weight and bias): this rank's rows of x, B, C.

``SliceCopy`` records one such piece exactly; ``PlacementKind`` names a parameter's rule (a key
of ``SLICE_RULES``) and its HF tensors; ``slices_for`` gives the pieces of one rank. Pure
geometry: which mapping class gets which kind is ``plan.placement``'s table. The same
description drives the CPU loader (each rank reads only its slices from disk) and the export
plan's source layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from mbridge_refit.errors import InputError

__all__ = [
    "AttentionHeads",
    "PlacementError",
    "PlacementKind",
    "RowLayout",
    "SLICE_RULES",
    "ShardContext",
    "SliceCopy",
    "check_tiling",
    "hf_extents",
    "place_column",
    "place_components",
    "place_gated",
    "place_gdn_conv1d",
    "place_gdn_in_proj",
    "place_gdn_in_proj_separate",
    "place_mamba_conv1d",
    "place_mamba_in_proj",
    "place_qkv",
    "place_qkv_concatenated",
    "place_qkv_gated",
    "place_replicated",
    "place_row",
    "slices_for",
]


class PlacementError(InputError):
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


class _QueryGroups(NamedTuple):
    """This rank's query groups of a QKV layer: their global indices, heads per group, head size."""

    groups: range
    heads_per_group: int
    head_dim: int


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionHeads:
    """The head layout a fused-QKV mapping's split reads from its layer's own config (the
    bridge's ``_get_config(module)``), recorded per layer: a model may vary it from layer to layer
    (Gemma 4's full-attention layers have their own head size and KV heads) or hold attention
    with other heads (a vision tower). Field names are ``TransformerConfig``'s."""

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int | None
    hidden_size: int
    attention_output_gate: bool = False

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> "AttentionHeads":
        config = getattr(module, "config", None)
        if config is None:
            raise PlacementError(f"{type(module).__name__} has no config to read its attention heads from")
        return cls(
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels,
            hidden_size=config.hidden_size,
            attention_output_gate=bool(getattr(config, "attention_output_gate", False)),
        )


def _query_groups(ctx: ShardContext, *, gated: bool) -> _QueryGroups:
    """The query groups ``ctx``'s rank holds; refuses a layer whose gate setting is not ``gated``
    and KV heads that tensor parallelism would have to replicate. ``ctx.config``: the layer's
    ``AttentionHeads`` (``slices_for`` puts them there) or a config with the same fields."""
    config = ctx.config
    if bool(getattr(config, "attention_output_gate", False)) != gated:
        raise PlacementError(
            f"QKV placement {'with' if gated else 'without'} an attention output gate on a model "
            f"{'without' if gated else 'with'} one"
        )
    heads, groups = config.num_attention_heads, config.num_query_groups
    if groups % ctx.tp_size:
        raise PlacementError(
            f"num_query_groups={groups} is not divisible by tp={ctx.tp_size}: replicated KV heads are not supported"
        )
    local_groups = groups // ctx.tp_size
    return _QueryGroups(
        groups=range(ctx.tp_rank * local_groups, (ctx.tp_rank + 1) * local_groups),
        heads_per_group=heads // groups,
        head_dim=config.kv_channels or config.hidden_size // heads,
    )


def place_qkv(q: str, k: str, v: str, ctx: ShardContext) -> list[SliceCopy]:
    return _qkv_slices(RowLayout(hf_name=q), RowLayout(hf_name=k), RowLayout(hf_name=v), ctx)


def place_qkv_concatenated(qkv: str, ctx: ShardContext) -> list[SliceCopy]:
    """QKV against one HF tensor holding all query heads, then all key heads, then all value heads
    (``ConcatenatedQKVMapping``: stock's split, concatenated; vision towers' ``attn.qkv``)."""
    heads = ctx.config
    head_dim = heads.kv_channels or heads.hidden_size // heads.num_attention_heads
    q_rows, kv_rows = heads.num_attention_heads * head_dim, heads.num_query_groups * head_dim
    return _qkv_slices(
        RowLayout(hf_name=qkv), RowLayout(hf_name=qkv, base=q_rows), RowLayout(hf_name=qkv, base=q_rows + kv_rows), ctx
    )


def _qkv_slices(q: "RowLayout", k: "RowLayout", v: "RowLayout", ctx: ShardContext) -> list[SliceCopy]:
    """For each local query group: its query heads' rows of ``q``, its key head's of ``k``, its value head's of ``v``."""
    local_groups, heads_per_group, head_dim = _query_groups(ctx, gated=False)
    q_rows = heads_per_group * head_dim
    copies: list[SliceCopy] = []
    for group in local_groups:
        copies += q.slices(group * q_rows, (group + 1) * q_rows, local_start=_covered(copies))
        for layout in (k, v):
            copies += layout.slices(group * head_dim, (group + 1) * head_dim, local_start=_covered(copies))
    if _covered(copies) != ctx.local_shape[0]:
        raise PlacementError(f"QKV slices cover {_covered(copies)} rows but the local shard has {ctx.local_shape[0]}")
    return copies


def place_qkv_gated(q: str, k: str, v: str, ctx: ShardContext) -> list[SliceCopy]:
    """QKV with ``attention_output_gate`` (Megatron-Bridge's ``split_qkv_weights``): each local
    query group holds its query heads, its gate heads, its key head, its value head; HF's
    ``q_proj`` holds, per query head, the head's query rows then its gate rows."""
    local_groups, heads_per_group, head_dim = _query_groups(ctx, gated=True)
    query_rows = RowLayout(hf_name=q, base=0, chunk=head_dim, stride=2 * head_dim)
    gate_rows = RowLayout(hf_name=q, base=head_dim, chunk=head_dim, stride=2 * head_dim)
    copies: list[SliceCopy] = []
    for group in local_groups:
        head_rows = (group * heads_per_group * head_dim, (group + 1) * heads_per_group * head_dim)
        copies += query_rows.slices(*head_rows, local_start=_covered(copies))
        copies += gate_rows.slices(*head_rows, local_start=_covered(copies))
        for name in (k, v):
            copies += RowLayout(hf_name=name).slices(
                group * head_dim, (group + 1) * head_dim, local_start=_covered(copies)
            )
    if _covered(copies) != ctx.local_shape[0]:
        raise PlacementError(
            f"gated QKV slices cover {_covered(copies)} rows but the local shard has {ctx.local_shape[0]}"
        )
    return copies


@dataclass(frozen=True, kw_only=True, slots=True)
class RowLayout:
    """Where the rows of one component (e.g. GDN's ``k``) sit in an HF tensor: row ``j`` of the
    component is HF row ``base + (j // chunk) * stride + j % chunk`` (chunks of ``chunk`` rows,
    ``stride`` apart: a component interleaved per head with others); ``chunk=None``: rows
    ``base + j`` (the component stored contiguously)."""

    hf_name: str
    base: int = 0
    chunk: int | None = None
    stride: int | None = None

    def slices(self, start: int, stop: int, *, local_start: int) -> list[SliceCopy]:
        """The HF slices of component rows ``[start, stop)``, placed from ``local_start`` on."""
        copies, row = [], start
        while row < stop:
            if self.chunk is None:
                end, hf_row = stop, self.base + row
            else:
                end = min(stop, (row // self.chunk + 1) * self.chunk)
                hf_row = self.base + (row // self.chunk) * self.stride + row % self.chunk
            copies.append(
                SliceCopy(
                    hf_name=self.hf_name,
                    dim=0,
                    hf_start=hf_row,
                    hf_stop=hf_row + end - row,
                    local_start=local_start + row - start,
                )
            )
            row = end
        return copies


def _covered(copies: list[SliceCopy]) -> int:
    return sum(c.length for c in copies)


def place_components(components: list[tuple[int, RowLayout]], ctx: ShardContext) -> list[SliceCopy]:
    """A local shard made of this rank's even share of each component in turn (GDN's ``in_proj``
    and ``conv1d``): ``components`` lists each one's global row count and HF layout."""
    copies: list[SliceCopy] = []
    for rows, layout in components:
        if rows % ctx.tp_size:
            raise PlacementError(f"{layout.hf_name}: a component of {rows} rows does not split over tp={ctx.tp_size}")
        start, stop = _even_split(rows // ctx.tp_size, ctx.tp_rank)
        copies += layout.slices(start, stop, local_start=_covered(copies))
    return copies


def _gdn_dims(config: Any) -> tuple[int, int, int, int]:
    """(key head dim, key heads, value rows per key head, value heads per key head) of a GDN layer."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if value_heads % key_heads:
        raise PlacementError(
            f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}"
        )
    per_key = value_heads // key_heads
    return config.linear_key_head_dim, key_heads, per_key * config.linear_value_head_dim, per_key


def place_gdn_in_proj(qkvz: str, ba: str, ctx: ShardContext) -> list[SliceCopy]:
    """GDN ``in_proj`` against Qwen3-Next's fused tensors (``split_gdn_linear_weights``): per key
    head, ``in_proj_qkvz`` holds the head's q, k, v, z rows and ``in_proj_ba`` its b, a rows."""
    key_dim, key_heads, value_rows, per_key = _gdn_dims(ctx.config)
    qkvz_stride, ba_stride = 2 * key_dim + 2 * value_rows, 2 * per_key
    return place_components(
        [
            (key_heads * key_dim, RowLayout(hf_name=qkvz, base=0, chunk=key_dim, stride=qkvz_stride)),
            (key_heads * key_dim, RowLayout(hf_name=qkvz, base=key_dim, chunk=key_dim, stride=qkvz_stride)),
            (key_heads * value_rows, RowLayout(hf_name=qkvz, base=2 * key_dim, chunk=value_rows, stride=qkvz_stride)),
            (
                key_heads * value_rows,
                RowLayout(hf_name=qkvz, base=2 * key_dim + value_rows, chunk=value_rows, stride=qkvz_stride),
            ),
            (key_heads * per_key, RowLayout(hf_name=ba, base=0, chunk=per_key, stride=ba_stride)),
            (key_heads * per_key, RowLayout(hf_name=ba, base=per_key, chunk=per_key, stride=ba_stride)),
        ],
        ctx,
    )


def place_gdn_in_proj_separate(qkv: str, z: str, b: str, a: str, ctx: ShardContext) -> list[SliceCopy]:
    """GDN ``in_proj`` against Qwen3.5's separate tensors: ``in_proj_qkv`` = [q; k; v] flat,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` whole components."""
    _, key_heads, value_rows, per_key = _gdn_dims(ctx.config)
    return place_components(
        [
            *_flat_qkv_components(qkv, ctx.config),
            (key_heads * value_rows, RowLayout(hf_name=z)),
            (key_heads * per_key, RowLayout(hf_name=b)),
            (key_heads * per_key, RowLayout(hf_name=a)),
        ],
        ctx,
    )


def place_gdn_conv1d(conv: str, ctx: ShardContext) -> list[SliceCopy]:
    """GDN ``conv1d`` (weight or bias; ``GDNConv1dMapping``): HF's channels are [q; k; v] flat."""
    return place_components(_flat_qkv_components(conv, ctx.config), ctx)


def _flat_qkv_components(name: str, config: Any) -> list[tuple[int, RowLayout]]:
    """GDN's q, k and v stored one after the other in ``name`` (Qwen3.5's ``in_proj_qkv``, ``conv1d``)."""
    key_dim, key_heads, value_rows, _ = _gdn_dims(config)
    return _flat_components(name, (key_heads * key_dim, key_heads * key_dim, key_heads * value_rows))


def _mamba_dims(config: Any) -> tuple[int, int, int]:
    """(inner rows ``heads * head_dim``, B or C rows ``groups * state``, heads) of a Mamba mixer."""
    heads = config.mamba_num_heads
    if heads is None:
        raise PlacementError(
            "a Mamba mixer without mamba_num_heads has no slice description (the bridge's mappings read it)"
        )
    return heads * config.mamba_head_dim, config.mamba_num_groups * config.mamba_state_dim, heads


def place_mamba_in_proj(in_proj: str, ctx: ShardContext) -> list[SliceCopy]:
    """Mamba ``in_proj`` (``MambaInProjMapping``): HF's rows are [z; x; B; C; dt] flat, and each
    rank holds its even share of each component in turn (Megatron's ``partition_sizes``)."""
    inner, ssm, heads = _mamba_dims(ctx.config)
    return place_components(_flat_components(in_proj, (inner, inner, ssm, ssm, heads)), ctx)


def place_mamba_conv1d(conv: str, ctx: ShardContext) -> list[SliceCopy]:
    """Mamba ``conv1d`` weight or bias (``MambaConv1dMapping``): HF's channels are [x; B; C] flat."""
    inner, ssm, _ = _mamba_dims(ctx.config)
    return place_components(_flat_components(conv, (inner, ssm, ssm)), ctx)


def _flat_components(name: str, rows: tuple[int, ...]) -> list[tuple[int, RowLayout]]:
    """Components of ``rows`` rows each, stored one after the other in ``name``."""
    bases = [sum(rows[:i]) for i in range(len(rows))]
    return [(count, RowLayout(hf_name=name, base=base)) for count, base in zip(rows, bases)]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementKind:
    """How one Megatron parameter is built from HF tensors: a rule name and its HF tensor names.

    Small and picklable: the rank that owns a parameter computes it (it needs the module to
    tell column from row parallel) and sends it to ranks that do not own the parameter.
    """

    kind: str  # a key of SLICE_RULES: "column", "row", "replicated", "gated", "qkv", "qkv_gated", "qkv_concatenated", "gdn_*", "mamba_*"
    hf_names: tuple[str, ...]
    elementwise_op: str | None = None  # a key of ELEMENTWISE_OPS, applied after the slices on export
    relayout: str | None = None  # a key of RELAYOUTS, applied to the whole tensor the slices make
    heads: AttentionHeads | None = None  # the layer's own head layout: the rule reads it instead of the model's config


def _slices_single(rule: Callable[[str, ShardContext], list[SliceCopy]]):
    return lambda names, ctx: rule(names[0], ctx)


SLICE_RULES: dict[str, Callable[[tuple[str, ...], ShardContext], list[SliceCopy]]] = {
    "column": _slices_single(place_column),
    "row": _slices_single(place_row),
    "replicated": _slices_single(place_replicated),
    "gated": lambda names, ctx: place_gated(*names, ctx),
    "qkv": lambda names, ctx: place_qkv(*names, ctx),
    "qkv_gated": lambda names, ctx: place_qkv_gated(*names, ctx),
    "qkv_concatenated": _slices_single(place_qkv_concatenated),
    "gdn_in_proj": lambda names, ctx: place_gdn_in_proj(*names, ctx),
    "gdn_in_proj_separate": lambda names, ctx: place_gdn_in_proj_separate(*names, ctx),
    "gdn_conv1d": _slices_single(place_gdn_conv1d),
    "mamba_in_proj": _slices_single(place_mamba_in_proj),
    "mamba_conv1d": _slices_single(place_mamba_conv1d),
}


def slices_for(kind: PlacementKind, ctx: ShardContext) -> list[SliceCopy]:
    """The HF slices making up the local shard described by ``ctx`` (pure: any rank can ask).
    A placement that recorded its layer's ``heads`` is placed with them, not the model's config."""
    if kind.heads is not None:
        ctx = ctx._replace(config=kind.heads)
    return SLICE_RULES[kind.kind](kind.hf_names, ctx)


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
        raise PlacementError(f"{where}: slices cover {cursor} along dim {dim}, local shard shape is {local_shape}")
