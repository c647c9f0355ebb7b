"""How an inference engine slices each HF tensor across its ranks: the target of a sharded refit.

An engine at tensor-parallel size ``tp`` needs only its part of each tensor, cut by the engine's
own rules (vLLM's, kept here as a table keyed by the kind the export plan already records):

| tensor (export plan kind, role)           | engine rule   | engine rank r of tp keeps                                  |
| ----------------------------------------- | ------------- | ---------------------------------------------------------- |
| q of a fused QKV (``qkv``, 0)             | ``q_heads``   | rows of query heads ``[r*H/tp, (r+1)*H/tp)``               |
| k, v of a fused QKV (``qkv``, 1 and 2)    | ``kv_heads``  | rows of its kv heads; with fewer kv heads than ranks, kv   |
|                                           |               | head ``r // (tp/KV)`` whole (replicated, as vLLM does)     |
| gate, up (``gated``), other ``column``    | ``column``    | rows ``[r*n/tp, (r+1)*n/tp)``                              |
| ``row``                                   | ``row``       | columns ``[r*n/tp, (r+1)*n/tp)``; a 1-D bias whole         |
| embedding, output layer                   | ``vocab``     | rows ``[r*p, (r+1)*p)`` of the vocabulary padded to a      |
|                                           |               | multiple of ``vocab_padding``, ``p = padded/tp`` (the      |
|                                           |               | padding rows are the engine's own; nothing is sent there)  |
| norms, routers (``replicated``)           | ``replicated``| the whole tensor                                           |
| an expert's tensors, engine ``ep > 1``    | ``expert``    | experts ``[r*E/ep, (r+1)*E/ep)`` whole, nothing of others  |
| an expert's tensors, engine ``ep == 1``   | as dense      | gate/up by rows, down by columns (vLLM's fused MoE at TP)  |

A region of a tensor is a ``Box``: one ``(start, stop)`` per dimension, in HF coordinates. A
tensor a rule cannot slice (a dimension the engine size does not divide, a plan kind without a
rule) is refused with ``EngineShardingError`` naming the tensor, before any data moves. Pure
metadata: imports only ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mbridge_refit.errors import InputError
from mbridge_refit.plan.entries import PlanEntry
from mbridge_refit.plan.layout import ModelShape

__all__ = [
    "Box",
    "ENGINE_RULES",
    "EngineLayout",
    "EngineShardingError",
    "EngineTensor",
    "RULES",
    "VLLM_VOCAB_PADDING",
    "VOCAB_PARAMS",
    "box_shape",
    "engine_box",
    "engine_rule",
    "whole",
    "with_extent",
]

Box = tuple[tuple[int, int], ...]

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE for VocabParallelEmbedding / ParallelLMHead

# Megatron parameters whose HF tensors an engine splits over the (padded) vocabulary.
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")

# (export plan kind, role within the kind's HF names or None for every role) -> engine rule
ENGINE_RULES: dict[tuple[str, int | None], str] = {
    ("qkv", 0): "q_heads",
    ("qkv", 1): "kv_heads",
    ("qkv", 2): "kv_heads",
    ("gated", None): "column",
    ("column", None): "column",
    ("row", None): "row",
    ("replicated", None): "replicated",
}


class EngineShardingError(InputError):
    """An engine layout that cannot slice a tensor (the tensor, the numbers and the fix named)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineLayout:
    """An inference engine's parallel layout.

    Attributes:
        tp: engine tensor-parallel size (its ranks are engine ranks ``0 .. tp-1``).
        ep: engine expert-parallel size: 1 (experts split like dense MLPs over ``tp``) or ``tp``
            (experts whole, engine rank r holding the r-th contiguous group, as vLLM's expert
            parallelism with data-parallel size 1).
        vocab_padding: the vocabulary is padded to a multiple of this before it is split.
    """

    tp: int = 1
    ep: int = 1
    vocab_padding: int = VLLM_VOCAB_PADDING

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "vocab_padding"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineShardingError(f"engine {name} must be a positive integer, got {value!r}")
        if self.ep not in (1, self.tp):
            raise EngineShardingError(
                f"engine ep={self.ep} with tp={self.tp}: the engine's expert-parallel ranks are its tensor-parallel "
                f"ranks, so ep must be 1 or {self.tp}"
            )

    @property
    def ranks(self) -> int:
        return self.tp

    @property
    def name(self) -> str:
        """``tp2``, ``tp2_ep2``."""
        return f"tp{self.tp}" + (f"_ep{self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, text: str) -> "EngineLayout":
        """``"tp2"``, ``"tp4_ep4"`` or ``"ep2"`` (= ``tp2_ep2``)."""
        sizes = {"tp": 1, "ep": 1}
        for part in text.lower().split("_"):
            key, digits = part[:2], part[2:]
            if key not in sizes or not digits.isdigit():
                raise EngineShardingError(f"cannot read engine layout {text!r}: write e.g. tp2, tp4 or tp2_ep2")
            sizes[key] = int(digits)
        if sizes["ep"] > 1 and "tp" not in text.lower():
            sizes["tp"] = sizes["ep"]
        return cls(**sizes)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineTensor:
    """What a rule reads about one HF tensor."""

    hf_name: str
    shape: tuple[int, ...]
    rule: str
    expert: int | None = None  # global expert index of an expert tensor


def engine_rule(entry: PlanEntry, role: int, layout: EngineLayout) -> str:
    """The engine rule for ``entry`` (``role``: its position among its Megatron parameter's HF names)."""
    if entry.is_expert and layout.ep > 1:
        return "expert"
    if entry.megatron_param in VOCAB_PARAMS:
        return "vocab"
    rule = ENGINE_RULES.get((entry.kind, role)) or ENGINE_RULES.get((entry.kind, None))
    if rule is None:
        raise EngineShardingError(
            f"{entry.hf_name}: the export plan's kind {entry.kind!r} (role {role}) has no engine sharding rule "
            f"(known: {sorted(set(ENGINE_RULES.values()))}); add it to ENGINE_RULES"
        )
    return rule


def engine_box(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box | None:
    """The region of ``tensor`` engine rank ``rank`` keeps (None: nothing of it)."""
    return RULES[tensor.rule](tensor, rank, layout, shape)


def whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, size) for size in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def with_extent(box: Box, dim: int, start: int, stop: int) -> Box:
    """``box`` with its extent along ``dim`` replaced by ``[start, stop)``."""
    return box[:dim] + ((start, stop),) + box[dim + 1 :]


def _split(tensor: EngineTensor, dim: int, parts: int, index: int, what: str) -> Box:
    size = tensor.shape[dim]
    if size % parts:
        raise EngineShardingError(
            f"{tensor.hf_name}: engine {what}={parts} does not divide its dimension {dim} ({size}): choose an engine "
            f"size dividing {size}"
        )
    step = size // parts
    return with_extent(whole(tensor.shape), dim, index * step, (index + 1) * step)


def _column(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    return _split(tensor, 0, layout.tp, rank, "tp")


def _row(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    if len(tensor.shape) == 1:
        return whole(tensor.shape)
    return _split(tensor, 1, layout.tp, rank, "tp")


def _replicated(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    return whole(tensor.shape)


def _q_heads(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    if shape.num_attention_heads % layout.tp:
        raise EngineShardingError(
            f"{tensor.hf_name}: engine tp={layout.tp} does not divide num_attention_heads={shape.num_attention_heads}"
        )
    return _split(tensor, 0, layout.tp, rank, "tp")


def _kv_heads(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    kv = shape.num_key_value_heads
    if kv >= layout.tp:
        if kv % layout.tp:
            raise EngineShardingError(
                f"{tensor.hf_name}: engine tp={layout.tp} does not divide num_key_value_heads={kv}"
            )
        return _split(tensor, 0, layout.tp, rank, "tp")
    if layout.tp % kv:
        raise EngineShardingError(
            f"{tensor.hf_name}: with num_key_value_heads={kv} < engine tp={layout.tp}, tp must be a multiple of {kv} "
            "(each kv head is replicated on tp/kv ranks)"
        )
    return _split(tensor, 0, kv, rank // (layout.tp // kv), "kv heads")


def _vocab(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box:
    rows = tensor.shape[0]
    padded = -(-rows // layout.vocab_padding) * layout.vocab_padding
    if padded % layout.tp:
        raise EngineShardingError(
            f"{tensor.hf_name}: the padded vocabulary ({padded} = {rows} rounded up to {layout.vocab_padding}) is not "
            f"divisible by engine tp={layout.tp}"
        )
    per_rank = padded // layout.tp
    start = min(rank * per_rank, rows)
    return with_extent(whole(tensor.shape), 0, start, min(start + per_rank, rows))


def _expert(tensor: EngineTensor, rank: int, layout: EngineLayout, shape: ModelShape) -> Box | None:
    if not shape.num_experts or shape.num_experts % layout.ep:
        raise EngineShardingError(
            f"{tensor.hf_name}: engine ep={layout.ep} does not divide num_experts={shape.num_experts}"
        )
    if tensor.expert is None:
        raise EngineShardingError(f"{tensor.hf_name}: an expert rule needs the tensor's expert index")
    return whole(tensor.shape) if tensor.expert // (shape.num_experts // layout.ep) == rank else None


RULES: dict[str, Callable[[EngineTensor, int, EngineLayout, ModelShape], Box | None]] = {
    "column": _column,
    "row": _row,
    "replicated": _replicated,
    "q_heads": _q_heads,
    "kv_heads": _kv_heads,
    "vocab": _vocab,
    "expert": _expert,
}
