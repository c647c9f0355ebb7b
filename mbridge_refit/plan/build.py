"""Building the export plan from a model: once per (bridge, model), from metadata alone.

Parameter names, shapes and dtypes, the bridge's mappings and ``placement``'s slice rules. No
tensor data moves and no weight memory is allocated, so it works on models built on the meta
device; the only communication is the bridge's exchange of parameter names across pipeline
stages and one gather of per-rank parameter descriptions over the model's ranks (the whole job
unless a group is given; ``exchange_contributions``). The two halves are separate functions:
``rank_contribution`` (what this rank holds, including how the trainer stores each parameter,
e.g. as TE blockwise FP8) and ``assemble_plan`` (pure: the same plan from the same contributions
on every rank), so a plan can also be built from contributions gathered another way
(``scripts/simulate_plan.py``). What a rank sends in that exchange (``encode_contribution``) starts
with ``PLAN_EXCHANGE_VERSION`` in a fixed header, read before anything else of it: ranks of another
mbridge_refit (another version, or none: one from before the exchange carried it) are refused by name,
with a ``PlanError`` on every rank (each rank reads every rank's header), before any contribution
is unpickled.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.errors import wire_version_mismatch
from mbridge_refit.plan.conversions import relaid_shape
from mbridge_refit.plan.entries import (
    ExportPlan,
    PlanEntry,
    PlanError,
    TensorSharding,
    expert_number,
    with_expert_number,
)
from mbridge_refit.plan.layout import megatron_parallel_state
from mbridge_refit.plan.placement import placement_kind
from mbridge_refit.plan.slices import PlacementError, PlacementKind, ShardContext, SliceCopy, slices_for
from mbridge_refit.plan.stacking import ExpertStack, stacked_placement
from mbridge_refit.plan.storage import PLAIN, storage_format

__all__ = [
    "PLAN_EXCHANGE_VERSION",
    "ParallelSizes",
    "ParamSpec",
    "RankContribution",
    "StoredShapes",
    "assemble_plan",
    "build_export_plan",
    "current_sizes",
    "decode_contribution",
    "encode_contribution",
    "exchange_contributions",
    "plan_entries",
    "rank_contribution",
    "split_size",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """What the owning rank knows about one parameter; exchanged with every other rank."""

    global_name: str
    placement: PlacementKind
    local_shape: tuple[int, ...]
    dtype: str
    pp_rank: int
    vpp_stage: int
    is_expert: bool
    source_format: str = PLAIN
    stack: ExpertStack | None = None  # a grouped-export expert parameter (``plan.stacking``)
    dropped: frozenset[str] = frozenset()  # HF names the bridge's export hook leaves out (``_names_the_bridge_drops``)
    split_over: int = (
        1  # ranks the live parameter is split over (its tensor- or expert-tensor-parallel group), 1: whole
    )

    @classmethod
    def of_task(
        cls,
        task: Any,
        placement: PlacementKind,
        *,
        pp_rank: int,
        expert: bool,
        stack: ExpertStack | None = None,
        source_format: str = PLAIN,
    ) -> "ParamSpec":
        """The spec of a conversion task's local parameter (``task.param_weight``) placed so."""
        weight = task.param_weight
        return cls(
            global_name=task.global_param_name,
            placement=placement,
            local_shape=tuple(weight.shape),
            dtype=str(weight.dtype).removeprefix("torch."),
            pp_rank=pp_rank,
            vpp_stage=task.vp_stage or 0,
            is_expert=expert,
            source_format=source_format,
            stack=stack,
            split_over=split_size(weight, expert=expert),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RankContribution:
    """What one rank knows and every rank needs: the parameters it holds, its layers, its errors.

    Small and picklable; ``build_export_plan`` exchanges one per rank in a single object gather.
    """

    specs: tuple[ParamSpec, ...]
    layer_map: dict[int, tuple[int, int]]
    errors: tuple[str, ...]


def build_export_plan(
    model_bridge: Any,
    hf_pretrained: Any,
    chunks: list[torch.nn.Module],
    tasks: list | None = None,
    group: Any = None,
    errors: tuple[str, ...] = (),
) -> ExportPlan:
    """Build the plan for ``chunks`` on this rank; collective over ``group``.

    ``group``: the process group of all ranks holding the model (default: the whole job; pass the
    trainer ranks' group when other ranks, e.g. refit receivers, share the job).
    ``tasks``: the bridge's conversion tasks for ``chunks`` if the caller has them already.
    ``errors``: what this rank's caller already failed at (building the tasks): contributed like
    this rank's own errors, so every rank raises the same ``PlanError``.
    Communication: the bridge's one exchange of parameter names over the pipeline group (inside
    ``build_conversion_tasks``) and one compressed exchange of ``RankContribution`` here (``exchange_contributions``).
    """
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(chunks)
    try:
        mine = rank_contribution(model_bridge, hf_pretrained, chunks, tasks)
    except Exception as err:  # any failure of this rank's part travels with the exchange: no rank is left waiting
        mine = RankContribution(specs=(), layer_map={}, errors=(f"{type(err).__name__}: {err}",))
    mine = dataclasses.replace(mine, errors=(*errors, *mine.errors))
    # One exchange for the whole job; errors travel with it so every rank raises the same.
    gathered = exchange_contributions(mine, group)
    return assemble_plan(gathered, current_sizes(chunks), chunks[0].config, model_bridge, hf_pretrained)


# The plan exchange's layout (the header, then the compressed pickle of RankContribution's fields):
# bump it with any change of what a contribution holds or means.
PLAN_EXCHANGE_VERSION = 1
_EXCHANGE_HEADER = b"mbridge_refit plan contribution v"  # then the version in decimal and a newline


def exchange_contributions(mine: Any, group: Any = None) -> list[Any]:
    """Every rank's ``mine`` (its contribution to a plan), in rank order; collective over ``group``.

    Sent compressed: a contribution describes each parameter the rank holds by names that repeat
    their parts (``decoder.layers.N.mlp.experts...``); DeepSeek-V3's at PP4 x EP8 are 6.3 MiB
    pickled and 0.46 MiB compressed, for about 2 ms a rank. 32 fresh gloo processes on 32 cores
    exchanged them in 0.9 s instead of 10 s, most of it each rank unpickling every contribution; on
    2 cores, where that unpickling is most of the cost, 20 s instead of 24 s (docs/benchmarks/scale.md). The
    senders are the job's own ranks: their payloads are unpickled as ``torch.distributed``'s object
    collectives do, each after its header's ``PLAN_EXCHANGE_VERSION`` was checked (``check_exchange_versions``:
    ``PlanError`` on every rank where any rank's differs)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, encode_contribution(mine), group=group)
    check_exchange_versions(gathered)
    return [decode_contribution(each) for each in gathered]


def encode_contribution(mine: Any) -> bytes:
    """What ``exchange_contributions`` sends of ``mine``: the versioned header, then ``mine`` pickled and
    compressed (level 1)."""
    header = _EXCHANGE_HEADER + b"%d\n" % PLAN_EXCHANGE_VERSION
    return header + zlib.compress(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL), 1)


def check_exchange_versions(gathered: list[Any]) -> None:
    """Refuse, by name, the ranks whose part of the exchange (``gathered``, in rank order) is of another
    ``PLAN_EXCHANGE_VERSION`` or carries none (``PlanError``); reads only the headers."""
    by_version: dict[Any, list[int]] = {}
    for rank, sent in enumerate(gathered):
        version = _exchange_version(sent)
        if version != PLAN_EXCHANGE_VERSION:
            by_version.setdefault(version, []).append(rank)
    if by_version:
        raise PlanError(
            "; ".join(_version_refusal(version, f"rank(s) {ranks}") for version, ranks in by_version.items())
        )


def decode_contribution(sent: bytes) -> Any:
    """A contribution from what ``encode_contribution`` made of it (a peer rank's: trusted, as above);
    another version, or none, raises ``PlanError`` before anything is unpickled."""
    version = _exchange_version(sent)
    if version != PLAN_EXCHANGE_VERSION:
        raise PlanError(_version_refusal(version, "the sending rank"))
    return pickle.loads(zlib.decompress(sent[sent.index(b"\n") + 1 :]))


def _exchange_version(sent: Any) -> int | None:
    """The version in ``sent``'s header, None where it has none (a rank from before it carried one)."""
    if not isinstance(sent, bytes) or not sent.startswith(_EXCHANGE_HEADER):
        return None
    start = len(_EXCHANGE_HEADER)
    end = sent.find(b"\n", start, start + 12)
    digits = sent[start:end] if end > start else b""
    return int(digits) if digits.isdigit() else None


def _version_refusal(version: int | None, peer: str) -> str:
    return wire_version_mismatch("plan exchange", PLAN_EXCHANGE_VERSION, version, peer)


def rank_contribution(
    model_bridge: Any, hf_pretrained: Any, chunks: list[torch.nn.Module], tasks: list | None = None
) -> RankContribution:
    """This rank's part of the plan, from metadata only (no tensor data is read or moved)."""
    from megatron.core import parallel_state as ps

    if tasks is None:
        tasks = model_bridge.build_conversion_tasks(hf_pretrained, chunks)
    specs, errors = [], []
    pp_rank = ps.get_pipeline_model_parallel_rank()
    hf_state = hf_pretrained.state if hasattr(hf_pretrained, "state") else {}  # what stock hands its export hook
    stored = StoredShapes(hf_pretrained)
    num_experts = chunks[0].config.num_moe_experts or 0
    if any(task is None for task in tasks):  # no mapping: stock's export fails on it, the rest would drop its values
        errors += [
            f"{name}: the model has this parameter but the bridge maps it to no HF tensor, so its values would not "
            "be exported"
            for name in _unmapped_local_names(model_bridge, chunks)
        ]
    for task in tasks:
        if task is not None and task.megatron_module is not None:
            try:
                if getattr(task, "export_hook", None) is not None:
                    raise PlanError(f"cannot plan {task.global_param_name}: its task has an export_hook (not planned)")
                spec = _local_spec(task, pp_rank, num_experts, stored)
                if spec.stack is None:  # stock runs the hook on every task but grouped-export ones
                    spec = dataclasses.replace(
                        spec, dropped=_names_the_bridge_drops(model_bridge, task, spec, hf_state)
                    )
                specs.append(spec)
            except PlanError as err:
                errors.append(str(err))
            except Exception as err:  # an unexpected bridge or parameter: this model falls back, on every rank
                errors.append(f"cannot plan {task.global_param_name}: {type(err).__name__}: {err}")
    return RankContribution(specs=tuple(specs), layer_map=_local_layer_map(chunks, pp_rank), errors=tuple(errors))


def _unmapped_local_names(model_bridge: Any, chunks: list[torch.nn.Module]) -> list[str]:
    """The global names of this rank's parameters that the bridge's mapping registry does not map (the
    rank holding such a parameter names it; where the lookup itself fails, one unnamed entry)."""
    try:
        from megatron.bridge.models.conversion.model_bridge import _megatron_local_name_to_global

        registry, config = model_bridge.mapping_registry(), chunks[0].config
        names = []
        for vp_stage, chunk in enumerate(chunks):
            for local_name, _ in chunk.named_parameters():
                if "_extra_state" in local_name or model_bridge._is_adapter_param_name(local_name):
                    continue
                name = _megatron_local_name_to_global(chunks, config, model_bridge._unwrap_name(local_name), vp_stage)
                if registry.megatron_to_hf_lookup(model_bridge._get_lora_unwrapped_name(name)) is None:
                    names.append(name)
        return names
    except Exception as err:  # noqa: BLE001 - the refusal stands, only its names are missing
        return [f"a parameter with no conversion task (its name could not be found: {type(err).__name__}: {err})"]


def current_sizes(chunks: list[torch.nn.Module]) -> "ParallelSizes":
    """The parallel sizes of this job (Megatron's parallel state) and the model's expert count."""
    return ParallelSizes(
        **megatron_parallel_state("world_size"), vpp=len(chunks), num_experts=chunks[0].config.num_moe_experts or 0
    )


def assemble_plan(
    contributions: list[RankContribution], sizes: "ParallelSizes", config: Any, model_bridge: Any, hf_pretrained: Any
) -> ExportPlan:
    """The plan from every rank's contribution (pure: the same on every rank). ``config``: the
    Megatron model config (QKV placement reads its head counts)."""
    all_errors = sorted({error for c in contributions for error in c.errors})
    if all_errors:
        raise PlanError(
            "; ".join(all_errors[:5]) + (f" (and {len(all_errors) - 5} more)" if len(all_errors) > 5 else "")
        )
    specs = _first_stage_specs(contributions)
    layer_map = {layer: where for c in contributions for layer, where in c.layer_map.items()}
    entries = _add_tied_output(plan_entries(specs, sizes, config), model_bridge, hf_pretrained, config)
    _check_complete(entries, _expected_hf_keys(hf_pretrained))
    _check_stored_shapes(entries, StoredShapes(hf_pretrained))
    return ExportPlan(
        entries=tuple(entries),
        layer_map=dict(sorted(layer_map.items())),
        tp=sizes.tp,
        pp=sizes.pp,
        ep=sizes.ep,
        vpp=sizes.vpp,
    )


def _first_stage_specs(contributions: list[RankContribution]) -> dict[str, ParamSpec]:
    """Each global name's spec, from the earliest pipeline stage that holds it. A name two stages hold
    is the embedding that a multi-token-prediction block keeps on the last stage beside the first
    stage's: stock exports the first stage's copy (it skips the MTP duplicate), so the plan does too."""
    specs: dict[str, ParamSpec] = {}
    for spec in (spec for c in contributions for spec in c.specs):
        held = specs.get(spec.global_name)
        if held is None or (spec.pp_rank, spec.vpp_stage) < (held.pp_rank, held.vpp_stage):
            specs[spec.global_name] = spec
    return specs


def plan_entries(specs: dict[str, ParamSpec], sizes: "ParallelSizes", config: Any) -> list[PlanEntry]:
    """The entries of every parameter of ``specs`` (every rank's, by global name), in the stock
    export's order (pure: the same on every rank). Raises ``PlanError`` naming a parameter whose
    slices the rules cannot place."""
    entries: list[PlanEntry] = []
    for name in sorted(specs, key=_sort_key):
        try:
            entries.extend(_entries_for(specs, name, sizes, config))
        except PlacementError as err:  # the same on every rank: every rank falls back alike
            raise PlanError(f"cannot plan {name}: {err}") from err
    return entries


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSizes:
    tp: int
    pp: int
    ep: int
    dp: int
    edp: int
    vpp: int
    num_experts: int
    etp: int = 1  # expert tensor-parallel size (Megatron's default: the tensor-parallel size)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep


def _sort_key(name: str):
    from megatron.bridge.models.conversion.utils import extract_sort_key

    return extract_sort_key(name)


def _local_spec(task: Any, pp_rank: int, num_experts: int, stored: "StoredShapes") -> ParamSpec:
    weight = task.param_weight
    try:
        stacked = None
        if getattr(task.mapping, "is_grouped_export", False):
            stored_shape = stored.shape(str(task.mapping.hf_param))
            stacked = stacked_placement(
                task.mapping,
                tuple(weight.shape),
                num_experts=num_experts,
                stored_shape=stored_shape,
                partition_dim=getattr(weight, "partition_dim", None),
            )
        placement, stack = (
            stacked if stacked is not None else (placement_kind(task.mapping, task.megatron_module), None)
        )
    except PlacementError as err:
        raise PlanError(f"cannot plan {task.global_param_name}: {err}") from err
    return ParamSpec.of_task(
        task,
        placement,
        pp_rank=pp_rank,
        expert=bool(task.mapping.is_expert),
        stack=stack,
        source_format=storage_format(weight),
    )


def split_size(param: torch.Tensor, *, expert: bool) -> int:
    """Over how many ranks the live model splits ``param``: Megatron marks a split parameter with
    ``tensor_model_parallel``; the group is the expert tensor-parallel group for a routed expert's
    parameter and the tensor-parallel group otherwise (as the bridge's mappings gather them)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return 1
    return ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()


class StoredShapes:
    """The shapes the source checkpoint stores tensors in, read from its metadata (safetensors
    headers, or an in-memory state's tensors), once per name; None for a tensor it does not hold
    or a bridge without a checkpoint. What stock decides an adaptive transpose from (it loads the
    tensor to read its shape)."""

    def __init__(self, hf_pretrained: Any):
        self._source = getattr(getattr(hf_pretrained, "state", None), "source", None)
        self._shapes: dict[str, tuple[int, ...] | None] = {}
        self._keys: set[str] | None = None
        self._files_read: set[str] = set()

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._shapes:
            self._shapes[name] = self._read(name)
        return self._shapes[name]

    def _read(self, name: str) -> tuple[int, ...] | None:
        source = self._source
        if source is None:
            return None
        if self._keys is None:
            self._keys = set(source.get_all_keys())
        if name not in self._keys:
            return None
        files = getattr(source, "key_to_filename_map", None)
        if files and name in files:
            self._read_header(files[name])
            return self._shapes.get(name)
        return tuple(source[name].shape)

    def _read_header(self, file_name: str) -> None:
        """Every shape one safetensors file stores (its header only), once per file."""
        if file_name in self._files_read:
            return
        from safetensors import safe_open

        self._files_read.add(file_name)
        with safe_open(str(self._source.path / file_name), framework="pt") as handle:
            for key in handle.keys():
                self._shapes[key] = tuple(handle.get_slice(key).get_shape())


def _check_stored_shapes(entries: list[PlanEntry], stored: "StoredShapes") -> None:
    """Every planned tensor the source checkpoint holds has the shape it is stored with there
    (its safetensors headers; no data is read): the plan is checked against an oracle the model
    did not derive, where the bridge has one."""
    wrong = [
        (e.hf_name, e.shape, shape)
        for e in entries
        if (shape := stored.shape(e.hf_name)) is not None and shape != e.shape
    ]
    if wrong:
        name, planned, shape = wrong[0]
        raise PlanError(
            f"the export plan's shapes differ from the source checkpoint's for {len(wrong)} tensor(s), e.g. {name}: "
            f"planned {list(planned)}, stored {list(shape)}"
        )


def _names_the_bridge_drops(model_bridge: Any, task: Any, spec: ParamSpec, hf_state: Any) -> frozenset[str]:
    """The HF names of ``task`` that the bridge's export hook removes from stock's output.

    Stock passes each task's converted tensors through ``maybe_modify_converted_hf_weight``. A
    bridge may drop names there (Gemma 4: the KV projections that exist only in Megatron, on
    KV-shared layers and, with ``attention_k_eq_v``, the full-attention layers' ``v_proj``), add
    names or replace tensors (requantization, aliases, swapped halves). The hook is run on empty
    meta tensors: names it drops are left out of the plan; a name it adds, a tensor it replaces or
    an error it raises is a conversion the plan cannot describe, and the model falls back."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    hook = type(model_bridge).maybe_modify_converted_hf_weight
    if hook is MegatronModelBridge.maybe_modify_converted_hf_weight:
        return frozenset()
    probes = {name: torch.empty(0, device="meta") for name in spec.placement.hf_names}
    where = f"cannot plan {spec.global_name}: {type(model_bridge).__name__}.maybe_modify_converted_hf_weight"
    try:
        kept = model_bridge.maybe_modify_converted_hf_weight(task, dict(probes), hf_state)
    except Exception as err:  # the hook needs real values: it converts them
        raise PlanError(f"{where} fails on metadata ({type(err).__name__}: {err}), so it converts values") from err
    changed = sorted(name for name, tensor in kept.items() if probes.get(name) is not tensor)
    if changed:
        raise PlanError(f"{where} adds or replaces {changed[:3]}, a conversion the slice rules cannot describe")
    return frozenset(probes) - frozenset(kept)


def _entries_for(specs: dict[str, ParamSpec], name: str, sizes: ParallelSizes, config: Any) -> list[PlanEntry]:
    spec = specs[name]
    if spec.stack is not None:
        return _stacked_entries(specs, name, sizes)
    entries = _dense_entries(spec, sizes, config) if not spec.is_expert else _expert_entries(specs, name, sizes, config)
    for entry in entries:
        member = specs[entry.megatron_param]
        _check_split(member, entry, sizes.etp if member.is_expert else sizes.tp)
    return entries


def _check_split(spec: ParamSpec, entry: PlanEntry, sliced_over: int) -> None:
    """The plan cuts ``entry`` over as many ranks as the live model splits its parameter over
    (``ParamSpec.split_over``: the parameter's ``tensor_model_parallel`` mark and the size of the
    group it was built with); a plan that would read one rank's shard as the whole tensor (a
    split it does not know of, as expert tensor parallelism was) is refused here rather than
    exported with another shape. (An unmarked parameter proves nothing: Megatron leaves some
    split ones unmarked, e.g. the attention sinks' ``softmax_offset``.)"""
    if spec.split_over > 1 and spec.split_over != sliced_over:
        group = "expert tensor-parallel" if spec.is_expert else "tensor-parallel"
        raise PlacementError(
            f"the live model splits {spec.global_name} {list(spec.local_shape)} over {spec.split_over} ranks of its {group} "
            f"group, but the plan cuts {entry.hf_name} over {sliced_over}"
        )


def _expert_entries(specs: dict[str, ParamSpec], name: str, sizes: ParallelSizes, config: Any) -> list[PlanEntry]:
    spec = specs[name]
    expert = expert_number(name)
    per_rank = sizes.experts_per_rank
    if expert >= per_rank:
        return []  # emitted with its local index's group, under the EP-rank-0 name
    group = [specs[with_expert_number(name, expert + k * per_rank)] for k in range(sizes.ep)]
    entries: list[PlanEntry] = []
    for output_index in range(len(spec.placement.hf_names)):
        for owner, member in enumerate(group):
            if member.placement.hf_names[output_index] not in member.dropped:
                entries.append(_expert_entry(member, output_index, owner, expert, sizes, config))
    return entries


def _dense_entries(spec: ParamSpec, sizes: ParallelSizes, config: Any) -> list[PlanEntry]:
    per_rank = [
        slices_for(
            spec.placement, ShardContext(local_shape=spec.local_shape, tp_rank=r, tp_size=sizes.tp, config=config)
        )
        for r in range(sizes.tp)
    ]
    entries = []
    for hf_name in (name for name in spec.placement.hf_names if name not in spec.dropped):
        pieces = tuple(tuple(c for c in rank if c.hf_name == hf_name) for rank in per_rank)
        replicated = all(rank == pieces[0] for rank in pieces)  # norms, routers, row-parallel biases
        shard_dim = pieces[0][0].dim
        sharding = TensorSharding(
            mesh_dims=("tp", "dp"),
            mesh_shape=(sizes.tp, sizes.dp),
            placements=("Replicate()" if replicated or sizes.tp == 1 else f"Shard({shard_dim})", "Replicate()"),
            pieces=pieces if not replicated else pieces[:1],
            local_shape=spec.local_shape,
        )
        entries.append(
            _entry(
                spec,
                hf_name,
                relaid_shape(spec.placement.relayout, _hf_shape(spec.local_shape, sharding.pieces)),
                sharding,
            )
        )
    return entries


def _expert_entry(
    spec: ParamSpec, output_index: int, owner: int, local_index: int, sizes: ParallelSizes, config: Any
) -> PlanEntry:
    """One HF tensor of one expert: owned by expert-parallel rank ``owner``, split over the
    expert tensor-parallel group as the expert's mapping splits it (``pieces[r]``: expert-TP rank
    r's slices; one entry where every expert-TP rank holds the same slices)."""
    if spec.placement.relayout is not None:
        raise PlacementError(f"an expert parameter with a {spec.placement.relayout!r} relayout has no expert assembly")
    hf_name = spec.placement.hf_names[output_index]
    per_rank = tuple(
        tuple(
            c
            for c in slices_for(
                spec.placement, ShardContext(local_shape=spec.local_shape, tp_rank=r, tp_size=sizes.etp, config=config)
            )
            if c.hf_name == hf_name
        )
        for r in range(sizes.etp)
    )
    replicated = all(rank == per_rank[0] for rank in per_rank)
    pieces = per_rank[:1] if replicated else per_rank
    owned = "Owned()" if sizes.ep > 1 else "Replicate()"
    if sizes.etp == 1:
        mesh = dict(mesh_dims=("ep", "edp"), mesh_shape=(sizes.ep, sizes.edp), placements=(owned, "Replicate()"))
    else:
        split = "Replicate()" if replicated else f"Shard({pieces[0][0].dim})"
        mesh = dict(
            mesh_dims=("ep", "etp", "edp"),
            mesh_shape=(sizes.ep, sizes.etp, sizes.edp),
            placements=(owned, split, "Replicate()"),
        )
    sharding = TensorSharding(
        **mesh,
        pieces=pieces,
        local_shape=spec.local_shape,
        owner_ep_rank=owner,
        local_expert_index=local_index,
    )
    return _entry(spec, hf_name, _hf_shape(spec.local_shape, pieces), sharding)


def _stacked_entries(specs: dict[str, ParamSpec], name: str, sizes: ParallelSizes) -> list[PlanEntry]:
    """A stacked expert tensor, planned once at expert 0's parameter: one entry, all E experts.

    Stock yields it when its last expert has been converted; a layer's expert parameters sort
    together, so expert 0's place gives the same order among the other tensors.
    """
    if expert_number(name) != 0:
        return []
    spec = specs[name]
    if spec.stack.split not in (1, sizes.etp) or (spec.split_over > 1 and spec.split_over != spec.stack.split):
        raise PlacementError(
            f"the stacked expert tensor {spec.placement.hf_names[0]} is split over {spec.stack.split} rank(s), the live "
            f"parameter over {spec.split_over} and the expert tensor-parallel group has {sizes.etp}"
        )
    members = [specs.get(with_expert_number(name, e)) for e in range(sizes.num_experts)]
    odd = [e for e, m in enumerate(members) if m is None or (m.local_shape, m.stack) != (spec.local_shape, spec.stack)]
    if odd or not sizes.num_experts or sizes.num_experts % sizes.ep:
        raise PlacementError(
            f"the stacked expert tensor {spec.placement.hf_names[0]} needs all {sizes.num_experts} experts alike, "
            f"divided evenly over ep={sizes.ep}; experts {odd[:5]} are missing or differ"
        )
    stack = dataclasses.replace(spec.stack, num_experts=sizes.num_experts)
    sharding = TensorSharding(
        mesh_dims=("ep", "edp"),
        mesh_shape=(sizes.ep, sizes.edp),
        placements=("Shard(0)" if sizes.ep > 1 else "Replicate()", "Replicate()"),
        pieces=(),
        local_shape=spec.local_shape,
        stack=stack,
    )
    shape = (sizes.num_experts, *stack.expert_shape(spec.local_shape))
    return [_entry(spec, spec.placement.hf_names[0], shape, sharding)]


# The fields a plan entry takes as they are from its parameter's spec, and from the spec's placement.
_FROM_SPEC = ("dtype", "pp_rank", "vpp_stage", "is_expert", "source_format")
_FROM_PLACEMENT = ("kind", "elementwise_op", "relayout")


def _entry(spec: ParamSpec, hf_name: str, shape: tuple[int, ...], sharding: TensorSharding) -> PlanEntry:
    """The entry of ``hf_name``: its own name, shape and sharding; the rest is its parameter's."""
    return PlanEntry(
        hf_name=hf_name,
        shape=shape,
        sharding=sharding,
        megatron_param=spec.global_name,
        **{field: getattr(spec, field) for field in _FROM_SPEC},
        **{field: getattr(spec.placement, field) for field in _FROM_PLACEMENT},
    )


def _hf_shape(local_shape: tuple[int, ...], pieces: tuple[tuple[SliceCopy, ...], ...]) -> tuple[int, ...]:
    dim = pieces[0][0].dim
    extent = max(c.hf_stop for rank in pieces for c in rank)
    shape = list(local_shape)
    shape[dim] = extent
    return tuple(shape)


def _local_layer_map(chunks: list[torch.nn.Module], pp_rank: int) -> dict[int, tuple[int, int]]:
    """Global layer index -> (pp rank, vpp stage), read from the layer modules themselves."""
    layers: dict[int, tuple[int, int]] = {}
    for vpp_stage, chunk in enumerate(chunks):
        decoder = getattr(chunk, "decoder", None)
        for layer in getattr(decoder, "layers", []):
            layers[layer.layer_number - 1] = (pp_rank, vpp_stage)
    return layers


def _add_tied_output(entries: list[PlanEntry], model_bridge: Any, hf_pretrained: Any, config: Any) -> list[PlanEntry]:
    """Mirror the stock export: with tied embeddings, emit the output weight name after the embedding
    when the checkpoint names it (config-only bridges always emit it)."""
    if not getattr(config, "share_embeddings_and_output_weights", False):
        return entries
    registry = model_bridge.mapping_registry()
    output_mapping = registry.megatron_to_hf_lookup("output_layer.weight")
    embedding_mapping = registry.megatron_to_hf_lookup("embedding.word_embeddings.weight")
    if output_mapping is None or output_mapping.hf_param == embedding_mapping.hf_param:
        return entries
    expected = _expected_hf_keys(hf_pretrained)
    if expected is not None and output_mapping.hf_param not in expected:
        return entries
    result = []
    for entry in entries:
        result.append(entry)
        if entry.hf_name == embedding_mapping.hf_param:
            result.append(dataclasses.replace(entry, hf_name=output_mapping.hf_param, alias_of=entry.hf_name))
    return result


def _expected_hf_keys(hf_pretrained: Any) -> set[str] | None:
    source = getattr(getattr(hf_pretrained, "state", None), "source", None)
    return set(source.get_all_keys()) if source is not None else None


def _check_complete(entries: list[PlanEntry], expected: set[str] | None) -> None:
    """The plan must name every tensor of the source checkpoint, and nothing twice."""
    counts = Counter(e.hf_name for e in entries)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    missing = sorted(expected - counts.keys()) if expected is not None else []
    if duplicates or missing:
        raise PlanError(
            f"the export plan does not cover the checkpoint: missing {missing[:10]}, duplicated {duplicates[:10]}"
        )
