"""Where the pieces of each HF tensor sit inside a rank's local Megatron parameter.

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

``SliceCopy`` records one such piece exactly. The rules are a table keyed by the bridge's
mapping class (``placement_rules``), then a table keyed by placement kind (``SLICE_RULES``);
a mapping class without a rule is reported by name.
The same description drives the CPU loader (each rank reads only its slices from disk) and the
export plan's source layout.

A few mappings convert values as well: the exported tensor is the base class's slices followed by
an elementwise op that stock applies in the parameter's dtype (Qwen3-Next's zero-centred RMSNorm:
``+ 1``). ``elementwise_op_rules`` names them (mapping class -> op name, a key of
``ELEMENTWISE_OPS``); ``PlacementKind.elementwise_op`` carries the op into the plan.

Others re-lay the whole tensor out: the exported tensor is the base class's whole tensor
transposed (``AutoMapping(permute_dims=(1, 0))``: Gemma 3 VL's projector) or given a leading
dimension of 1 (ERNIE 4.5's expert bias, ``_SqueezeBiasMapping``). ``RELAYOUTS`` describes each
(its shape and a view of the tensor either way), ``relayout_rules`` names the mapping classes
that apply one, and ``PlacementKind.relayout`` carries it into the plan; the slices describe
the tensor before the re-layout.
"""

from __future__ import annotations

import dataclasses
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
        raise PlacementError(f"QKV placement {'with' if gated else 'without'} an attention output gate on a model "
                             f"{'without' if gated else 'with'} one")
    heads, groups = config.num_attention_heads, config.num_query_groups
    if groups % ctx.tp_size:
        raise PlacementError(
            f"num_query_groups={groups} is not divisible by tp={ctx.tp_size}: replicated KV heads are not supported"
        )
    local_groups = groups // ctx.tp_size
    return _QueryGroups(groups=range(ctx.tp_rank * local_groups, (ctx.tp_rank + 1) * local_groups),
                        heads_per_group=heads // groups, head_dim=config.kv_channels or config.hidden_size // heads)


def place_qkv(q: str, k: str, v: str, ctx: ShardContext) -> list[SliceCopy]:
    return _qkv_slices(RowLayout(hf_name=q), RowLayout(hf_name=k), RowLayout(hf_name=v), ctx)


def place_qkv_concatenated(qkv: str, ctx: ShardContext) -> list[SliceCopy]:
    """QKV against one HF tensor holding all query heads, then all key heads, then all value heads
    (``ConcatenatedQKVMapping``: stock's split, concatenated; vision towers' ``attn.qkv``)."""
    heads = ctx.config
    head_dim = heads.kv_channels or heads.hidden_size // heads.num_attention_heads
    q_rows, kv_rows = heads.num_attention_heads * head_dim, heads.num_query_groups * head_dim
    return _qkv_slices(RowLayout(hf_name=qkv), RowLayout(hf_name=qkv, base=q_rows), RowLayout(hf_name=qkv, base=q_rows + kv_rows), ctx)


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
            copies += RowLayout(hf_name=name).slices(group * head_dim, (group + 1) * head_dim, local_start=_covered(copies))
    if _covered(copies) != ctx.local_shape[0]:
        raise PlacementError(f"gated QKV slices cover {_covered(copies)} rows but the local shard has {ctx.local_shape[0]}")
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
            copies.append(SliceCopy(
                hf_name=self.hf_name, dim=0, hf_start=hf_row, hf_stop=hf_row + end - row, local_start=local_start + row - start,
            ))
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
        raise PlacementError(f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}")
    per_key = value_heads // key_heads
    return config.linear_key_head_dim, key_heads, per_key * config.linear_value_head_dim, per_key


def place_gdn_in_proj(qkvz: str, ba: str, ctx: ShardContext) -> list[SliceCopy]:
    """GDN ``in_proj`` against Qwen3-Next's fused tensors (``split_gdn_linear_weights``): per key
    head, ``in_proj_qkvz`` holds the head's q, k, v, z rows and ``in_proj_ba`` its b, a rows."""
    key_dim, key_heads, value_rows, per_key = _gdn_dims(ctx.config)
    qkvz_stride, ba_stride = 2 * key_dim + 2 * value_rows, 2 * per_key
    return place_components([
        (key_heads * key_dim, RowLayout(hf_name=qkvz, base=0, chunk=key_dim, stride=qkvz_stride)),
        (key_heads * key_dim, RowLayout(hf_name=qkvz, base=key_dim, chunk=key_dim, stride=qkvz_stride)),
        (key_heads * value_rows, RowLayout(hf_name=qkvz, base=2 * key_dim, chunk=value_rows, stride=qkvz_stride)),
        (key_heads * value_rows, RowLayout(hf_name=qkvz, base=2 * key_dim + value_rows, chunk=value_rows, stride=qkvz_stride)),
        (key_heads * per_key, RowLayout(hf_name=ba, base=0, chunk=per_key, stride=ba_stride)),
        (key_heads * per_key, RowLayout(hf_name=ba, base=per_key, chunk=per_key, stride=ba_stride)),
    ], ctx)


def place_gdn_in_proj_separate(qkv: str, z: str, b: str, a: str, ctx: ShardContext) -> list[SliceCopy]:
    """GDN ``in_proj`` against Qwen3.5's separate tensors: ``in_proj_qkv`` = [q; k; v] flat,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` whole components."""
    _, key_heads, value_rows, per_key = _gdn_dims(ctx.config)
    return place_components([
        *_flat_qkv_components(qkv, ctx.config),
        (key_heads * value_rows, RowLayout(hf_name=z)),
        (key_heads * per_key, RowLayout(hf_name=b)),
        (key_heads * per_key, RowLayout(hf_name=a)),
    ], ctx)


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
        raise PlacementError("a Mamba mixer without mamba_num_heads has no slice description (the bridge's mappings read it)")
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


def _auto_kind(mapping: Any, module: torch.nn.Module) -> PlacementKind:
    permute = getattr(mapping, "permute_dims", None)
    if permute is not None and tuple(permute) != (1, 0):
        raise PlacementError(f"AutoMapping with permute_dims={mapping.permute_dims} has no slice description")
    # AutoMapping.megatron_to_hf permutes the gathered tensor with permute_dims: (1, 0) is a transpose
    return PlacementKind(kind=_detected_kind(mapping, module), hf_names=(mapping.hf_param,), relayout=None if permute is None else "transpose")


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
    return PlacementKind(kind="qkv_concatenated", hf_names=(str(mapping.hf_param),), heads=AttentionHeads.of_module(module))


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
    from megatron.bridge.models.minimax_m2.minimax_m2_bridge import _FullDimQKNormMapping

    return [(_FullDimQKNormMapping, _full_dim_qk_norm_kind)]


@functools.cache
def placement_rules() -> list[tuple[type, Callable[[Any, torch.nn.Module], PlacementKind]]]:
    """Mapping class -> how to name its placement. Most specific first: the first isinstance match wins."""
    from megatron.bridge.models.conversion import param_mapping as pm

    return [
        *_family_rules(),
        (pm.QKVMapping, _qkv_kind),
        (pm.ConcatenatedQKVMapping, _concatenated_qkv_kind),
        (pm.GDNLinearMapping, lambda m, _: PlacementKind(kind="gdn_in_proj", hf_names=(m.hf_param["qkvz"], m.hf_param["ba"]))),
        (pm.GDNLinearMappingSeparate, lambda m, _: PlacementKind(
            kind="gdn_in_proj_separate", hf_names=tuple(m.hf_param[c] for c in ("qkv", "z", "b", "a")))),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class ElementwiseOp:
    """An elementwise conversion a mapping applies on top of its base class's slices, in the
    parameter's dtype and in place, exactly as the mapping does: ``export`` as its
    ``megatron_to_hf`` does, ``load`` (the inverse) as its ``hf_to_megatron`` does."""

    export: Callable[[torch.Tensor], Any]
    load: Callable[[torch.Tensor], Any]


ELEMENTWISE_OPS: dict[str, ElementwiseOp] = {
    # RMSNorm2ZeroCenteredRMSNormMapping: ``value.data += 1`` on export, ``-= 1`` on import
    "add_one": ElementwiseOp(export=lambda t: t.add_(1), load=lambda t: t.sub_(1)),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Relayout:
    """A re-layout a mapping applies to the whole tensor its base class's conversion makes:
    ``export_shape`` of the base tensor's shape (None where the mapping leaves such a tensor as
    it is), ``base_shape`` the inverse, ``export`` a view of the base tensor laid out as exported
    (the exporter copies it into the output), ``load`` a view of the stored tensor laid out as
    the base (what the CPU loader slices)."""

    export_shape: Callable[[tuple[int, ...]], tuple[int, ...] | None]
    base_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    export: Callable[[torch.Tensor], torch.Tensor]
    load: Callable[[torch.Tensor], torch.Tensor]


RELAYOUTS: dict[str, Relayout] = {
    # AutoMapping(permute_dims=(1, 0)).megatron_to_hf: torch.permute(gathered, (1, 0)).contiguous(), 2-D only
    "transpose": Relayout(
        export_shape=lambda shape: (shape[1], shape[0]) if len(shape) == 2 else None,
        base_shape=lambda shape: (shape[1], shape[0]),
        export=lambda tensor: tensor.t(),
        load=lambda tensor: tensor.t(),
    ),
    # _SqueezeBiasMapping.megatron_to_hf: v.unsqueeze(0) if v.ndim == 1 else v
    "unsqueeze0": Relayout(
        export_shape=lambda shape: (1, *shape) if len(shape) == 1 else None,
        base_shape=lambda shape: tuple(shape[1:]),
        export=lambda tensor: tensor.unsqueeze(0),
        load=lambda tensor: tensor.squeeze(0),
    ),
}


def relaid_shape(relayout: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` is exported in after ``relayout`` (``shape`` itself for
    None); a ``PlacementError`` where the relayout has no description for such a tensor."""
    if relayout is None:
        return tuple(shape)
    relaid = RELAYOUTS[relayout].export_shape(tuple(shape))
    if relaid is None:
        raise PlacementError(f"its {relayout!r} relayout has no description for a tensor of shape {list(shape)}")
    return relaid


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


def slices_for(kind: PlacementKind, ctx: ShardContext) -> list[SliceCopy]:
    """The HF slices making up the local shard described by ``ctx`` (pure: any rank can ask).
    A placement that recorded its layer's ``heads`` is placed with them, not the model's config."""
    if kind.heads is not None:
        ctx = ctx._replace(config=kind.heads)
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
