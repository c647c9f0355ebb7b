"""Parallel layouts: the typed (tp, pp, vpp, ep, etp) description of how a model is split.

Owns validation of a layout against a world size and a model shape. Every check here runs on
plain numbers, before any process group or collective exists, so a bad layout fails fast on
every rank with the same message instead of hanging inside a gather.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """A parallel layout that cannot hold the requested model or world size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How a Megatron model is split across ranks.

    Attributes:
        tp: tensor-parallel size for non-expert weights.
        pp: pipeline-parallel size.
        vpp: virtual pipeline stages per PP rank (None = no interleaving).
        ep: expert-parallel size (MoE only).
        etp: expert tensor-parallel size (only 1 is supported: experts are whole on each rank).
        first_stage_layers / last_stage_layers: uneven pipeline splits (Megatron's
            ``num_layers_in_first/last_pipeline_stage``); the middle stages share the rest evenly.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise LayoutError(f"vpp must be a positive integer or None, got {self.vpp!r}")
            if self.pp == 1 and self.vpp > 1:
                raise LayoutError(f"vpp={self.vpp} needs pp > 1: interleaving stages needs a pipeline.")
        if self.etp != 1:
            raise LayoutError(f"etp={self.etp} is not supported: use expert tensor parallel size 1.")
        if self.uneven and self.pp == 1:
            raise LayoutError("first/last stage layer counts need pp > 1.")
        if self.uneven and self.vpp_stages > 1:
            raise LayoutError("uneven first/last stages cannot be combined with vpp here: use an even split.")

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the non-expert weights (tp x pp)."""
        return self.tp * self.pp

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
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "_".join(parts) or "tp1"

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; raises if the layout does not divide it."""
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp} = "
                f"{self.model_parallel_size}; launch a multiple of {self.model_parallel_size} ranks "
                f"(e.g. torchrun --nproc-per-node {self.model_parallel_size})."
            )
        dp = world_size // self.model_parallel_size
        if (dp * self.tp) % self.ep:
            raise LayoutError(
                f"ep={self.ep} must divide dp*tp = {dp}*{self.tp} = {dp * self.tp} "
                f"(world size {world_size}, tp={self.tp}, pp={self.pp})."
            )
        return dp

    def validate_world_size(self, world_size: int, *, require_exact: bool = True) -> None:
        """Check the world size; with ``require_exact`` it must equal tp*pp*dp with dp = ep/tp or 1."""
        self.data_parallel_size(world_size)
        if require_exact and world_size != self.expected_world_size:
            raise LayoutError(
                f"world size {world_size} does not match layout {self.name}, which needs "
                f"{self.expected_world_size} ranks: run torchrun --nproc-per-node {self.expected_world_size}."
            )

    @property
    def expected_world_size(self) -> int:
        """Smallest world size holding this layout (dp grows until tp*dp is a multiple of ep)."""
        dp = 1
        while (dp * self.tp) % self.ep:
            dp += 1
        return self.model_parallel_size * dp

    def validate_model(self, shape: "ModelShape") -> None:
        """Check that every split this layout implies divides the model's dimensions."""
        checks = [
            (shape.num_attention_heads, self.tp, "num_attention_heads", "tp"),
            (shape.num_key_value_heads, self.tp, "num_key_value_heads", "tp"),
            (shape.vocab_size, self.tp, "vocab_size", "tp"),
        ]
        if not shape.num_experts:  # expert FFNs are whole on each rank (etp=1): only dense FFNs split
            checks.append((shape.intermediate_size, self.tp, "intermediate_size", "tp"))
        if shape.num_experts:
            checks.append((shape.num_experts, self.ep, "num_experts", "ep"))
        elif self.ep > 1:
            raise LayoutError(f"ep={self.ep} needs a mixture-of-experts model; this model has no experts.")
        for size, parts, what, flag in checks:
            if size % parts:
                raise LayoutError(
                    f"{flag}={parts} does not divide {what}={size}: choose a {flag} that divides {size}."
                )
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
        if middle_layers < middle_stages or (middle_stages == 0 and middle_layers != 0) or (
            middle_stages > 0 and middle_layers % middle_stages
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

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        heads = config.num_attention_heads
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        return cls(
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            vocab_size=config.vocab_size,
            intermediate_size=config.intermediate_size,
            num_experts=num_experts,
        )
