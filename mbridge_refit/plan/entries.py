"""The export plan's types: every HF tensor an export yields, in order, and where its pieces live.

``ExportPlan`` is identical on every rank and JSON-serialisable (``to_json`` / ``from_json``) for
another process (a refit receiver, an engine); the JSON carries ``EXPORT_PLAN_VERSION``, and
``from_json`` refuses another version, or none (a plan written by an mbridge_refit from before it was
versioned), by name before it reads anything else. Each ``PlanEntry`` names one HF tensor (shape,
dtype, the Megatron parameter it comes from, its owning pipeline stage) and its
``TensorSharding``: how the tensor's slices are laid out across the trainer's ranks. Built by
``plan.build``; run by ``runtime.exporter``.

Ordering follows Megatron-Bridge's stock export exactly: conversion tasks sorted by global
Megatron name, each task's HF tensors in mapping order (q, k, v; gate, up), expert tensors of one
local expert index grouped over expert-parallel ranks, and the tied output weight right after the
embedding when the checkpoint names it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from mbridge_refit.errors import InputError, wire_version_mismatch
from mbridge_refit.plan.conversions import RELAYOUTS
from mbridge_refit.plan.slices import SliceCopy
from mbridge_refit.plan.stacking import ExpertStack
from mbridge_refit.plan.storage import PLAIN

__all__ = [
    "EXPORT_PLAN_VERSION",
    "ExportPlan",
    "PlanEntry",
    "PlanError",
    "TensorSharding",
    "expert_number",
    "numel",
    "with_expert_number",
]

EXPORT_PLAN_VERSION = 1  # ExportPlan.to_json's layout: bump it with any change of what the JSON holds


class PlanError(InputError):
    """The model has a parameter the plan cannot describe (named in the message)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSharding:
    """How one HF tensor is laid out across the trainer's ranks, in HF coordinates.

    Non-expert tensors live on the (tp, dp) mesh of their pipeline stage; expert tensors on the
    (ep, expert-dp) mesh, owned by ``owner_ep_rank`` (with expert tensor parallelism, etp > 1,
    on the (ep, etp, expert-dp) mesh: the owner's expert-TP group splits them as the expert's
    mapping does). ``placements`` reads like DTensor's: ``Shard(d)`` or ``Replicate()`` for
    each mesh dimension. ``pieces[r]`` lists where tensor-parallel rank ``r`` (expert-TP rank
    ``r`` for an expert) keeps its slices of this HF tensor inside its local Megatron parameter
    (one entry when not split).

    A stacked expert tensor (``stack`` set, ``plan.stacking``) holds every expert of its layer:
    slot ``e`` is expert ``e``'s whole local parameter re-laid out as ``stack`` says, so it has no
    slice pieces; expert-parallel rank ``k`` holds slots ``[k*E/ep, (k+1)*E/ep)``
    (``Shard(0)`` over ``ep``).
    """

    mesh_dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    pieces: tuple[tuple[SliceCopy, ...], ...]
    local_shape: tuple[int, ...]
    owner_ep_rank: int | None = None
    local_expert_index: int | None = None
    stack: ExpertStack | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry:
    """One HF tensor the export yields."""

    hf_name: str
    shape: tuple[int, ...]
    dtype: str
    megatron_param: str
    pp_rank: int
    vpp_stage: int
    is_expert: bool
    kind: str
    sharding: TensorSharding
    alias_of: str | None = None  # tied output weight: the same data as this entry
    scale_of: str | None = None  # FP8 export: the blockwise scale of this weight entry (``fp8``)
    source_format: str = PLAIN  # how the trainer stores the parameter (``plan.storage``)
    elementwise_op: str | None = None  # applied to the assembled slices (``conversions.ELEMENTWISE_OPS``)
    relayout: str | None = (
        None  # applied to the whole assembled tensor (``conversions.RELAYOUTS``); ``shape`` is after it
    )

    @property
    def base_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the slices make: ``shape`` before the entry's relayout."""
        if self.relayout is None:
            return self.shape
        return RELAYOUTS[self.relayout].base_shape(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.torch_dtype.itemsize  # no tensor made: called per entry per packing


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportPlan:
    """All entries in export order, the layer map, and the layout the plan was built for."""

    entries: tuple[PlanEntry, ...]
    layer_map: dict[int, tuple[int, int]]  # global layer index -> (pp rank, vpp stage)
    tp: int
    pp: int
    ep: int
    vpp: int

    def names(self) -> list[str]:
        return [e.hf_name for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> str:
        """The plan as JSON, with ``EXPORT_PLAN_VERSION`` (what ``from_json`` reads back)."""
        payload = {"version": EXPORT_PLAN_VERSION, **dataclasses.asdict(self)}
        payload["layer_map"] = {str(k): list(v) for k, v in self.layer_map.items()}
        return json.dumps(payload, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ExportPlan":
        """``to_json``'s plan back; JSON of another ``EXPORT_PLAN_VERSION`` (or none) raises ``PlanError``
        naming both versions."""
        raw = json.loads(text)
        version = raw.pop("version", None) if isinstance(raw, dict) else None
        if type(version) is not int or version != EXPORT_PLAN_VERSION:
            raise PlanError(wire_version_mismatch("export plan", EXPORT_PLAN_VERSION, version, "its writer (to_json)"))
        entries = tuple(_entry_from_dict(e) for e in raw.pop("entries"))
        layer_map = {int(k): tuple(v) for k, v in raw.pop("layer_map").items()}
        return cls(entries=entries, layer_map=layer_map, **raw)


def _entry_from_dict(raw: dict[str, Any]) -> PlanEntry:
    sharding = dict(raw.pop("sharding"))
    sharding["pieces"] = tuple(tuple(SliceCopy(**p) for p in rank) for rank in sharding["pieces"])
    if sharding.get("stack") is not None:
        sharding["stack"] = ExpertStack(**sharding["stack"])
    for key in ("mesh_dims", "mesh_shape", "placements", "local_shape"):
        sharding[key] = tuple(sharding[key])
    return PlanEntry(**{**raw, "shape": tuple(raw["shape"]), "sharding": TensorSharding(**sharding)})


_EXPERT_NUMBER = re.compile(r"(local_experts\.)(\d+)(\.)|(\.weight|\.bias)(\d+)$")


def expert_number(name: str) -> int:
    match = _EXPERT_NUMBER.search(name)
    if match is None:
        raise PlanError(f"cannot find the expert number in {name!r}")
    return int(match.group(2) or match.group(5))


def with_expert_number(name: str, number: int) -> str:
    match = _EXPERT_NUMBER.search(name)
    if match is None:
        raise PlanError(f"cannot find the expert number in {name!r}")
    digits = 2 if match.group(1) else 5
    return f"{name[: match.start(digits)]}{number}{name[match.end(digits) :]}"


def numel(shape: Iterable[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
