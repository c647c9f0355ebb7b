"""What a LoRA adapter refit carries and what an engine can take, engine-agnostic.

An adapter refit gives a running engine the trainer's LoRA factors in place of the previous
adapter, leaving the base weights alone. It carries the tensors ``RefitBridge.export_adapter_weights``
yields (HF PEFT names: ``model.layers.0.self_attn.q_proj.lora_A.weight`` / ``...lora_B.weight``,
A ``[r, in]``, B ``[out, r]``), named as a PEFT checkpoint stores them (``PEFT_PREFIX`` + name, as
Megatron-Bridge's ``save_hf_adapter`` writes ``adapter_model.safetensors``), and the
``adapter_config.json`` fields an engine reads (``adapter_config``, from ``RefitBridge.adapter_facts``).

An engine states what it can take as ``AdapterLimits`` (its largest rank, the module names an
adapter can land in, how many adapters it holds at once). ``check_adapter`` refuses by name, before
any tensor moves, what it could not take exactly: a rank above the limit, per-module ranks or alphas
(an engine that reads one ``r`` and one ``lora_alpha`` would scale them wrongly), expert adapters,
tensors that are not a 2-D factor pair. ``unplaced`` names the adapter modules no engine module
takes (run on the engine side, where the engine's own name mapping applies).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mbridge_refit.errors import EngineError, wire_version_mismatch

__all__ = [
    "FACTOR_SUFFIXES",
    "PEFT_PREFIX",
    "LIMITS_VERSION",
    "AdapterLimits",
    "AdapterRefusedError",
    "adapter_config",
    "check_adapter",
    "peft_names",
    "unplaced",
]

LIMITS_VERSION = 1  # the engine's reply of its LoRA limits (AdapterLimits.to_wire)
PEFT_PREFIX = "base_model.model."  # what a PEFT checkpoint puts before every HF name
FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_EXPERTS = ".experts."


class AdapterRefusedError(EngineError):
    """The engine cannot take this adapter exactly; the message names what and why."""


@dataclass(frozen=True, kw_only=True)
class AdapterLimits:
    """What an engine's LoRA support takes: ``max_rank`` (its largest ``r``), ``slots`` (adapters it
    runs at once), ``modules`` (the full module names an adapter can land in, as the engine names them
    after its own mapping of PEFT names)."""

    max_rank: int
    slots: int
    modules: frozenset[str]

    def to_wire(self) -> dict[str, Any]:
        """Plain data for the engine's reply, with ``LIMITS_VERSION``."""
        return {
            "version": LIMITS_VERSION,
            "max_rank": self.max_rank,
            "slots": self.slots,
            "modules": sorted(self.modules),
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> "AdapterLimits":
        """``to_wire``'s limits back; a reply of another ``LIMITS_VERSION`` (or none) raises ``EngineError``."""
        version = wire.get("version") if isinstance(wire, Mapping) else None
        if version != LIMITS_VERSION:
            raise EngineError(wire_version_mismatch("adapter limits", LIMITS_VERSION, version, "the engine"))
        return cls(max_rank=int(wire["max_rank"]), slots=int(wire["slots"]), modules=frozenset(wire["modules"]))


def adapter_config(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``adapter_config.json`` fields of ``facts`` (``RefitBridge.adapter_facts``) that an engine
    reads, as Megatron-Bridge's ``save_hf_adapter`` writes them for a plain LoRA."""
    return {
        "r": int(facts["r"]),
        "lora_alpha": facts["lora_alpha"],
        "target_modules": list(facts["target_modules"]),
        "bias": "none",
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def peft_names(names: Iterable[str]) -> list[str]:
    """``names`` as a PEFT checkpoint stores them (``PEFT_PREFIX`` + HF name)."""
    return [PEFT_PREFIX + name for name in names]


def check_adapter(shapes: Mapping[str, tuple[int, ...]], facts: Mapping[str, Any], limits: AdapterLimits) -> None:
    """Refuse (``AdapterRefusedError``, every problem named) an adapter the engine of ``limits`` could not
    take exactly. ``shapes``: HF PEFT name -> shape of every exported factor; ``facts``: its config."""
    problems = []
    if facts.get("rank_pattern") or facts.get("alpha_pattern"):
        problems.append(
            f"modules differ in rank or alpha (rank_pattern {dict(facts.get('rank_pattern') or {})}, alpha_pattern "
            f"{dict(facts.get('alpha_pattern') or {})}): the engine reads one r and one lora_alpha"
        )
    rank = int(facts["r"])
    if rank > limits.max_rank:
        problems.append(
            f"rank {rank} is above the engine's max_lora_rank {limits.max_rank}: start it with a larger one"
        )
    experts = sorted(name for name in shapes if _EXPERTS in name)
    if experts:
        problems.append(f"{len(experts)} expert adapter tensor(s), e.g. {experts[:2]}: expert adapters are not refit")
    odd = sorted(name for name in shapes if not name.endswith(FACTOR_SUFFIXES) and name not in experts)
    if odd:
        problems.append(f"tensor(s) that are no LoRA factor: {odd[:3]}")
    problems += _factor_problems(shapes, rank)
    if problems:
        raise AdapterRefusedError("the engine cannot take this adapter: " + "; ".join(problems))


def _factor_problems(shapes: Mapping[str, tuple[int, ...]], rank: int) -> list[str]:
    """A and B of every module present, 2-D, of rank ``rank``."""
    problems = []
    modules = {name.removesuffix(suffix) for name in shapes for suffix in FACTOR_SUFFIXES if name.endswith(suffix)}
    for module in sorted(modules):
        a, b = shapes.get(module + FACTOR_SUFFIXES[0]), shapes.get(module + FACTOR_SUFFIXES[1])
        if a is None or b is None:
            problems.append(f"{module} has {'B' if a is None else 'A'} without {'A' if a is None else 'B'}")
        elif len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            problems.append(f"{module}: A {tuple(a)} and B {tuple(b)} are not the factors of a rank-{rank} adapter")
    return problems


def unplaced(modules: Iterable[str], limits: AdapterLimits) -> list[str]:
    """The adapter ``modules`` (engine names) that no engine module takes: the engine would drop them."""
    return sorted(set(modules) - limits.modules)
