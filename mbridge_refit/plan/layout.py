"""Parallel layouts: the typed (tp, pp, vpp, cp, ep, etp) description of how a model is split.

The data-parallel size is not part of a layout: it is what the world size leaves,
``dp = world / (tp * pp * cp)``, as in Megatron-Core. Expert parallelism is carved from the
data-parallel, context-parallel and tensor-parallel ranks (``ep * etp`` divides ``tp * cp * dp``).

Owns validation of a layout against a world size and a model shape. Every check here runs on
plain numbers, before any process group or collective exists, so a bad layout fails fast on
every rank with the same message instead of hanging inside a gather.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from mbridge_refit.errors import InputError

__all__ = ["MEGATRON_GROUPS", "LayoutError", "ModelShape", "ParallelLayout", "megatron_parallel_state"]


class LayoutError(InputError):
    """A parallel layout that cannot hold the requested model or world size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How a Megatron model is split across ranks.

    Attributes:
        tp: tensor-parallel size for non-expert weights.
        pp: pipeline-parallel size.
        cp: context-parallel size (splits sequences, not weights: every context-parallel rank
            holds the same weights as its tensor/pipeline peers).
        vpp: virtual pipeline stages per PP rank (None = no interleaving).
        ep: expert-parallel size (MoE only).
        etp: expert tensor-parallel size: each routed expert split over this many ranks (Megatron-Core's
            own default, when a provider leaves it unset, is the tensor-parallel size; 1 keeps experts whole).
        first_stage_layers / last_stage_layers: uneven pipeline splits (Megatron's
            ``num_layers_in_first/last_pipeline_stage``); the middle stages share the rest evenly.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise LayoutError(f"vpp must be a positive integer or None, got {self.vpp!r}")
            if self.pp == 1 and self.vpp > 1:
                raise LayoutError(f"vpp={self.vpp} needs pp > 1: interleaving stages needs a pipeline.")
        if self.uneven and self.pp == 1:
            raise LayoutError("first/last stage layer counts need pp > 1.")
        if self.uneven and self.vpp_stages > 1:
            raise LayoutError("uneven first/last stages cannot be combined with vpp here: use an even split.")

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one data-parallel replica (tp x pp x cp); each CP rank holds the same weights."""
        return self.tp * self.pp * self.cp

    @property
    def vpp_stages(self) -> int:
        return self.vpp or 1

    @property
    def name(self) -> str:
        """Short label such as ``tp2``, ``pp2_vpp2`` or ``tp2_ep2`` (``tp1`` for no parallelism)."""
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.vpp and self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.uneven:
            parts.append(f"split{self.first_stage_layers or ''}-{self.last_stage_layers or ''}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        return "_".join(parts) or "tp1"

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; raises naming both numbers and the fix if
        the layout does not divide the world."""
        replica = self.model_parallel_size
        if world_size % replica:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {replica}: "
                f"launch a multiple of {replica} ranks (e.g. torchrun --nproc-per-node {self.expected_world_size}); "
                f"the ranks beyond one replica become data-parallel replicas."
            )
        dp = world_size // replica
        expert_ranks = dp * self.cp * self.tp
        if expert_ranks % (self.ep * self.etp):
            raise LayoutError(
                f"ep*etp = {self.ep}*{self.etp} must divide dp*cp*tp = {dp}*{self.cp}*{self.tp} = {expert_ranks} "
                f"(world size {world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}): launch "
                f"torchrun --nproc-per-node {self.expected_world_size} (or a multiple of it), or choose an ep dividing {expert_ranks}."
            )
        return dp

    def validate_world_size(self, world_size: int) -> int:
        """Check that the layout divides ``world_size``; returns the data-parallel size."""
        return self.data_parallel_size(world_size)

    @property
    def expected_world_size(self) -> int:
        """Smallest world size holding this layout (dp grows until ep*etp divides tp*cp*dp)."""
        dp = 1
        while (dp * self.cp * self.tp) % (self.ep * self.etp):
            dp += 1
        return self.model_parallel_size * dp

    def validate_model(self, shape: "ModelShape") -> None:
        """Check that every split this layout implies divides the model's dimensions."""
        checks = [
            (shape.num_attention_heads, self.tp, "num_attention_heads", "tp"),
            (shape.num_key_value_heads, self.tp, "num_key_value_heads", "tp"),
            (shape.vocab_size, self.tp, "vocab_size", "tp"),
        ]
        if not shape.num_experts:  # a MoE model's dense FFN size is checked by its mapping, experts below
            checks.append((shape.intermediate_size, self.tp, "intermediate_size", "tp"))
        if shape.num_experts:
            checks.append((shape.num_experts, self.ep, "num_experts", "ep"))
            checks.append((shape.expert_intermediate_size, self.etp, "the experts' intermediate size", "etp"))
        elif self.ep > 1 or self.etp > 1:
            raise LayoutError(
                f"ep={self.ep}, etp={self.etp} need a mixture-of-experts model; this model has no experts."
            )
        for size, parts, what, flag in checks:
            if size % parts:
                raise LayoutError(f"{flag}={parts} does not divide {what}={size}: choose a {flag} that divides {size}.")
        stages = self.pp * self.vpp_stages
        if self.uneven:
            self._validate_uneven(shape.num_layers)
        elif shape.num_layers % self.pp:
            raise LayoutError(
                f"pp={self.pp} does not divide num_layers={shape.num_layers}: choose a pp that divides it, or set "
                f"the first/last stage layer counts (--first-stage-layers / --last-stage-layers)."
            )
        if shape.num_layers < stages:
            raise LayoutError(
                f"pp*vpp = {self.pp}*{self.vpp_stages} = {stages} stages exceed num_layers={shape.num_layers}."
            )
        if self.vpp_stages > 1 and shape.num_layers % stages:
            raise LayoutError(
                f"pp*vpp = {stages} does not divide num_layers={shape.num_layers}: "
                f"with interleaving every stage needs the same number of layers."
            )

    def _validate_uneven(self, num_layers: int) -> None:
        edges = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
        if any(n < 1 for n in edges):
            raise LayoutError(f"first/last stage layer counts must be positive, got {edges}")
        middle_layers = num_layers - sum(edges)
        middle_stages = self.pp - len(edges)
        if (
            middle_layers < middle_stages
            or (middle_stages == 0 and middle_layers != 0)
            or (middle_stages > 0 and middle_layers % middle_stages)
        ):
            raise LayoutError(
                f"first/last stage layers {self.first_stage_layers}/{self.last_stage_layers} leave {middle_layers} "
                f"layers for {middle_stages} middle stages of pp={self.pp} (num_layers={num_layers}): they must split evenly."
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The dimensions of a model that a layout has to divide (read from an HF config)."""

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    num_experts: int = 0
    expert_intermediate_size: int = 0  # one routed expert's FFN size (what expert tensor parallelism splits)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        """The language model's dimensions: a vision-language config's ``text_config`` (transformers'
        ``get_text_config``) holds them; expert counts under any of their families' field names."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        experts = next((getattr(text, f) for f in _EXPERT_COUNT_FIELDS if getattr(text, f, None)), 0)
        intermediate = getattr(text, "intermediate_size", None) or 0
        return cls(
            num_layers=text.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            vocab_size=text.vocab_size,
            intermediate_size=intermediate,
            num_experts=experts,
            expert_intermediate_size=next(
                (getattr(text, f) for f in _EXPERT_SIZE_FIELDS if getattr(text, f, None)), intermediate
            ),
        )


# Megatron's process groups by the names plans give them; Megatron's parallel state reads this
# process's place in group g by ``get_<g>_world_size()`` and ``get_<g>_rank()``.
MEGATRON_GROUPS = {
    "tp": "tensor_model_parallel",
    "pp": "pipeline_model_parallel",
    "ep": "expert_model_parallel",
    "etp": "expert_tensor_parallel",
    "dp": "data_parallel",
    "edp": "expert_data_parallel",
}


def megatron_parallel_state(of: str, groups: Iterable[str] = tuple(MEGATRON_GROUPS)) -> dict[str, int]:
    """This process's ``"world_size"`` or ``"rank"`` in each of ``groups`` (names of
    ``MEGATRON_GROUPS``), read from Megatron's parallel state, which must be initialized."""
    from megatron.core import parallel_state as ps

    return {name: getattr(ps, f"get_{MEGATRON_GROUPS[name]}_{of}")() for name in groups}


# HF config fields that count a mixture-of-experts layer's routed experts, by family.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# HF config fields that hold one routed expert's FFN size, by family (else ``intermediate_size``).
_EXPERT_SIZE_FIELDS = ("moe_intermediate_size", "expert_intermediate_size")
