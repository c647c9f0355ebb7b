"""The slice rules of gated QKV, gated delta net and Mamba layers against Megatron-Bridge's own export.

Oracle: the upstream mapping's ``megatron_to_hf`` (its gather and split) run on every
tensor-parallel rank's random shard, with a stand-in for the tensor-parallel all-gather. Each
rank's ``slice_copies`` are then scattered into empty HF tensors: together they must rebuild
upstream's HF tensors exactly, every element written once.
"""

from __future__ import annotations

import types

import pytest
import torch

HIDDEN = 16

GATED_QKV = [  # (attention heads, query groups, head dim)
    (4, 2, 8),
    (8, 4, 4),
    (16, 4, 8),
    (8, 8, 4),
]
GDN = [  # (key heads, value heads, key head dim, value head dim)
    (4, 8, 8, 4),
    (4, 4, 8, 8),
    (8, 16, 4, 8),
    (4, 12, 4, 4),
]
MAMBA = [  # (heads, head dim, groups, state size)
    (8, 4, 2, 4),
    (4, 8, 1, 8),
    (8, 2, 8, 2),
    (12, 2, 4, 4),
]
TP_SIZES = (1, 2, 4)


class FakeTensorParallel:
    """Every tensor-parallel rank's shard of one parameter, and an all-gather over them.

    Shards hold distinct values, so the rows a mapping hands the gather identify which rows of
    its own shard they are; the gather returns the same rows of every rank's shard.
    """

    def __init__(self, global_shape: tuple[int, ...], tp: int):
        total = torch.Size(global_shape).numel()
        values = torch.randperm(total, generator=torch.Generator().manual_seed(0)).to(torch.float64)
        self.shards = list(values.reshape(global_shape).chunk(tp, dim=0))
        self.rank = 0

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        mine = self.shards[self.rank].reshape(self.shards[self.rank].shape[0], -1)
        index = {row[0].item(): i for i, row in enumerate(mine)}
        rows = torch.tensor([index[row[0].item()] for row in tensor.reshape(tensor.shape[0], -1)])
        return [shard[rows] for shard in self.shards]


def column_parallel_module(config) -> torch.nn.Module:
    """A module the bridge reads as a column-parallel linear of a layer with ``config``."""
    module = torch.nn.Module()
    module.config, module.tensor_model_parallel, module.partition_dim = config, True, 0
    return module


def upstream_export(
    mapping, fake: FakeTensorParallel, config, tp: int, monkeypatch, module=None
) -> dict[str, torch.Tensor]:
    """``mapping.megatron_to_hf`` on rank 0 of ``tp`` ranks (pipeline size 1)."""
    from megatron.bridge.models.conversion import param_mapping as pm

    monkeypatch.setattr(pm.MegatronParamMapping, "tp_size", property(lambda self: tp))
    monkeypatch.setattr(pm.MegatronParamMapping, "tp_rank", property(lambda self: fake.rank))
    monkeypatch.setattr(pm.MegatronParamMapping, "pp_size", property(lambda self: 1))
    monkeypatch.setattr(pm.MegatronParamMapping, "gather_from_tp_ranks", lambda _, tensor: fake.gather(tensor))
    module = module or column_parallel_module(config)
    fake.rank = 0
    return mapping.megatron_to_hf(fake.shards[0], module)


def rebuilt_from_slices(
    mapping,
    fake: FakeTensorParallel,
    config,
    tp: int,
    reference: dict[str, torch.Tensor],
    model_config=None,
    module=None,
):
    """The HF tensors rebuilt from every rank's ``slice_copies``, and how often each element was written.
    ``config``: the layer module's; ``model_config``: the model's (the plan's ``ShardContext``), default the same."""
    from mbridge_refit.plan.placement import placement_kind
    from mbridge_refit.plan.slices import ShardContext, check_tiling, slices_for

    kind = placement_kind(mapping, module or column_parallel_module(config))
    rebuilt = {name: torch.full_like(t, float("nan")) for name, t in reference.items()}
    writes = {name: torch.zeros(t.shape[0], dtype=torch.int64) for name, t in reference.items()}
    for rank, shard in enumerate(fake.shards):
        ctx = ShardContext(local_shape=tuple(shard.shape), tp_rank=rank, tp_size=tp, config=model_config or config)
        copies = slices_for(kind, ctx)
        check_tiling(mapping.megatron_param, ctx.local_shape, copies)
        for copy in copies:
            assert copy.dim == 0
            rebuilt[copy.hf_name][copy.hf_start : copy.hf_stop] = shard[
                copy.local_start : copy.local_start + copy.length
            ]
            writes[copy.hf_name][copy.hf_start : copy.hf_stop] += 1
    return kind, rebuilt, writes


def assert_rebuilds(mapping, global_shape, config, tp, monkeypatch, expected_kind, model_config=None, module=None):
    fake = FakeTensorParallel(global_shape, tp)
    reference = upstream_export(mapping, fake, config, tp, monkeypatch, module)
    kind, rebuilt, writes = rebuilt_from_slices(mapping, fake, config, tp, reference, model_config, module)
    assert kind.kind == expected_kind
    assert sorted(rebuilt) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(writes[name], torch.ones_like(writes[name])), f"{name}: rows written {writes[name].tolist()}"
        assert torch.equal(rebuilt[name], tensor), name


def gdn_config(key_heads, value_heads, key_dim, value_dim):
    return types.SimpleNamespace(
        hidden_size=HIDDEN,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim,
    )


def gdn_in_proj_rows(key_heads, value_heads, key_dim, value_dim):
    return 2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize(("heads", "groups", "head_dim"), GATED_QKV)
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_gated_qkv_slices_rebuild_upstream_split(heads, groups, head_dim, tp, bias, monkeypatch):
    if groups % tp:
        pytest.skip("Megatron needs query groups divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import QKVMapping

    config = types.SimpleNamespace(
        hidden_size=HIDDEN,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_output_gate=True,
    )
    suffix = "bias" if bias else "weight"
    mapping = QKVMapping(
        f"decoder.layers.0.self_attention.linear_qkv.{suffix}", *(f"l.0.{p}_proj.{suffix}" for p in "qkv")
    )
    rows = (2 * heads + 2 * groups) * head_dim
    assert_rebuilds(mapping, (rows,) if bias else (rows, HIDDEN), config, tp, monkeypatch, "qkv_gated")


LAYER_HEADS = [  # (model's query groups, head dim; the layer's query groups, head dim), 4 query heads
    (2, 8, 2, 32),
    (2, 8, 4, 16),
    (4, 16, 2, 8),
]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize(("model_groups", "model_head_dim", "groups", "head_dim"), LAYER_HEADS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_qkv_slices_follow_the_layers_own_heads(model_groups, model_head_dim, groups, head_dim, tp, gated, monkeypatch):
    """A layer whose config has other heads than the model's (Gemma 4's full-attention layers: their own
    head size and KV heads) is split with its own, as the bridge's split reads the module's config."""
    if groups % tp or model_groups % tp:
        pytest.skip("Megatron needs query groups divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import QKVMapping

    def heads(query_groups, size):
        return types.SimpleNamespace(
            hidden_size=HIDDEN,
            num_attention_heads=4,
            num_query_groups=query_groups,
            kv_channels=size,
            attention_output_gate=gated,
        )

    mapping = QKVMapping("decoder.layers.3.self_attention.linear_qkv.weight", *(f"l.3.{p}_proj.weight" for p in "qkv"))
    rows = ((2 if gated else 1) * 4 + 2 * groups) * head_dim
    assert_rebuilds(
        mapping,
        (rows, HIDDEN),
        heads(groups, head_dim),
        tp,
        monkeypatch,
        "qkv_gated" if gated else "qkv",
        model_config=heads(model_groups, model_head_dim),
    )


CONCATENATED_QKV = [  # (attention heads, query groups, head dim): a vision tower's MHA, and GQA
    (4, 4, 8),
    (8, 2, 4),
    (16, 4, 8),
]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize(("heads", "groups", "head_dim"), CONCATENATED_QKV)
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_concatenated_qkv_slices_rebuild_upstream_split(heads, groups, head_dim, tp, bias, monkeypatch):
    """``ConcatenatedQKVMapping`` (Qwen3.5's vision tower ``attn.qkv``): stock's q, k, v concatenated in
    one tensor; the layer's heads are the vision tower's, not the language model's (``model_config``)."""
    if groups % tp:
        pytest.skip("Megatron needs query groups divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import ConcatenatedQKVMapping

    config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim
    )
    language = types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=32, num_query_groups=8, kv_channels=2)
    suffix = "bias" if bias else "weight"
    mapping = ConcatenatedQKVMapping(
        f"vision_model.decoder.layers.0.self_attention.linear_qkv.{suffix}", f"v.blocks.0.attn.qkv.{suffix}"
    )
    rows = (heads + 2 * groups) * head_dim
    assert_rebuilds(
        mapping, (rows,) if bias else (rows, HIDDEN), config, tp, monkeypatch, "qkv_concatenated", model_config=language
    )


FULL_DIM_NORMS = [(4, 8), (8, 16), (2, 32)]  # (heads, head dim) of MiniMax-M2's q_norm / k_norm


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize(("heads", "head_dim"), FULL_DIM_NORMS)
def test_full_dim_qk_norm_slices_rebuild_upstream_gather(heads, head_dim, tp, monkeypatch):
    """MiniMax-M2's norm over all heads at once (``_FullDimQKNormMapping``): each rank's heads' rows."""
    if heads % tp:
        pytest.skip("the norm's heads split over tp ranks")
    from megatron.bridge.models.minimax_m2.minimax_m2_bridge import _FullDimQKNormMapping

    global_dim = heads * head_dim
    module = column_parallel_module(types.SimpleNamespace(hidden_size=HIDDEN))
    module.weight, module.global_dim = torch.empty(global_dim // tp), global_dim
    mapping = _FullDimQKNormMapping("decoder.layers.0.self_attention.k_layernorm.weight", "l.0.self_attn.k_norm.weight")
    assert_rebuilds(mapping, (global_dim,), module.config, tp, monkeypatch, "column", module=module)


def test_full_dim_qk_norm_shared_by_ranks_is_refused(monkeypatch):
    """Fewer KV heads than ranks: ranks hold copies of one shard (stock keeps one of each); refused by name."""
    from megatron.bridge.models.conversion import param_mapping as pm
    from megatron.bridge.models.minimax_m2.minimax_m2_bridge import _FullDimQKNormMapping

    from mbridge_refit.plan.placement import placement_kind
    from mbridge_refit.plan.slices import PlacementError

    monkeypatch.setattr(pm.MegatronParamMapping, "tp_size", property(lambda self: 4))
    module = column_parallel_module(types.SimpleNamespace(hidden_size=HIDDEN))
    module.weight, module.global_dim = torch.empty(16), 32  # 2 KV heads of 16 over 4 ranks
    mapping = _FullDimQKNormMapping("decoder.layers.0.self_attention.k_layernorm.weight", "l.0.self_attn.k_norm.weight")
    with pytest.raises(PlacementError, match="replicated KV heads are not supported"):
        placement_kind(mapping, module)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dims", GDN, ids=lambda d: "kh{}_vh{}_kd{}_vd{}".format(*d))
def test_gdn_in_proj_slices_rebuild_upstream_split(dims, tp, monkeypatch):
    if dims[0] % tp:
        pytest.skip("Megatron needs key heads divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import GDNLinearMapping

    mapping = GDNLinearMapping(
        "decoder.layers.0.self_attention.in_proj.weight", "l.0.in_proj_qkvz.weight", "l.0.in_proj_ba.weight"
    )
    assert_rebuilds(mapping, (gdn_in_proj_rows(*dims), HIDDEN), gdn_config(*dims), tp, monkeypatch, "gdn_in_proj")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dims", GDN, ids=lambda d: "kh{}_vh{}_kd{}_vd{}".format(*d))
def test_gdn_separate_in_proj_slices_rebuild_upstream_split(dims, tp, monkeypatch):
    if dims[0] % tp:
        pytest.skip("Megatron needs key heads divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import GDNLinearMappingSeparate

    mapping = GDNLinearMappingSeparate(
        "decoder.layers.0.self_attention.in_proj.weight", *(f"l.0.in_proj_{c}.weight" for c in ("qkv", "z", "b", "a"))
    )
    assert_rebuilds(
        mapping, (gdn_in_proj_rows(*dims), HIDDEN), gdn_config(*dims), tp, monkeypatch, "gdn_in_proj_separate"
    )


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dims", GDN, ids=lambda d: "kh{}_vh{}_kd{}_vd{}".format(*d))
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_gdn_conv1d_slices_rebuild_upstream_merge(dims, tp, bias, monkeypatch):
    if dims[0] % tp:
        pytest.skip("Megatron needs key heads divisible by tp")
    from megatron.bridge.models.conversion.param_mapping import GDNConv1dMapping

    key_heads, value_heads, key_dim, value_dim = dims
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    suffix = "bias" if bias else "weight"
    mapping = GDNConv1dMapping(f"decoder.layers.0.self_attention.conv1d.{suffix}", f"l.0.conv1d.{suffix}")
    assert_rebuilds(
        mapping, (channels,) if bias else (channels, 1, 4), gdn_config(*dims), tp, monkeypatch, "gdn_conv1d"
    )


def mamba_config(heads, head_dim, groups, state):
    return types.SimpleNamespace(
        hidden_size=HIDDEN,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_num_groups=groups,
        mamba_state_dim=state,
    )


def skip_unless_megatron_splits_mamba(heads, groups, tp):
    if heads % tp or groups % tp:
        pytest.skip("Megatron needs Mamba heads and groups divisible by tp")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dims", MAMBA, ids=lambda d: "h{}_hd{}_g{}_s{}".format(*d))
def test_mamba_in_proj_slices_rebuild_upstream_merge(dims, tp, monkeypatch):
    heads, head_dim, groups, state = dims
    skip_unless_megatron_splits_mamba(heads, groups, tp)
    from megatron.bridge.models.conversion.param_mapping import MambaInProjMapping

    mapping = MambaInProjMapping("decoder.layers.0.mixer.in_proj.weight", "l.0.mixer.in_proj.weight")
    rows = 2 * heads * head_dim + 2 * groups * state + heads  # z, x, B, C, dt
    assert_rebuilds(mapping, (rows, HIDDEN), mamba_config(*dims), tp, monkeypatch, "mamba_in_proj")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dims", MAMBA, ids=lambda d: "h{}_hd{}_g{}_s{}".format(*d))
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_mamba_conv1d_slices_rebuild_upstream_merge(dims, tp, bias, monkeypatch):
    heads, head_dim, groups, state = dims
    skip_unless_megatron_splits_mamba(heads, groups, tp)
    from megatron.bridge.models.conversion.param_mapping import MambaConv1dMapping

    channels = heads * head_dim + 2 * groups * state  # x, B, C
    suffix = "bias" if bias else "weight"
    mapping = MambaConv1dMapping(f"decoder.layers.0.mixer.conv1d_{suffix}", f"l.0.mixer.conv1d.{suffix}")
    assert_rebuilds(
        mapping, (channels,) if bias else (channels, 1, 4), mamba_config(*dims), tp, monkeypatch, "mamba_conv1d"
    )


def test_a_mamba_mixer_without_a_head_count_is_refused():
    from mbridge_refit.plan.slices import PlacementError, PlacementKind, ShardContext, slices_for

    config = types.SimpleNamespace(**{**vars(mamba_config(8, 4, 2, 4)), "mamba_num_heads": None})
    ctx = ShardContext(local_shape=(80, HIDDEN), tp_rank=0, tp_size=1, config=config)
    with pytest.raises(PlacementError, match="mamba_num_heads"):
        slices_for(PlacementKind(kind="mamba_in_proj", hf_names=("l.0.mixer.in_proj.weight",)), ctx)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_pp_safe_gated_mlp_slices_rebuild_upstream_split(tp, monkeypatch):
    """Ernie 4.5's ``_PPSafeGatedMLPMapping`` exports as ``GatedMLPMapping`` for a parameter a rank
    holds (its override only turns "no stage holds it" into ``{}``)."""
    from megatron.bridge.models.ernie.ernie_45_bridge import _PPSafeGatedMLPMapping

    config = types.SimpleNamespace(hidden_size=HIDDEN)
    mapping = _PPSafeGatedMLPMapping(
        "decoder.layers.0.mlp.linear_fc1.weight", "l.0.mlp.gate_proj.weight", "l.0.mlp.up_proj.weight"
    )
    assert_rebuilds(mapping, (8 * tp, HIDDEN), config, tp, monkeypatch, "gated")


def replicated_module(config) -> torch.nn.Module:
    """A module the bridge reads as replicated over tensor-parallel ranks (a router, a norm)."""
    module = torch.nn.Module()
    module.config, module.tensor_model_parallel = config, False
    return module


def _relayout_cases():
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.ernie.ernie_45_bridge import _SqueezeBiasMapping

    return {  # mapping, its module, a global shape (tp scales dim 0), the relayout
        # Gemma 3 VL's projector: AutoMapping(permute_dims=(1, 0)), the gathered tensor transposed
        "transposed-column": (
            AutoMapping("multi_modal_projector.proj.weight", "m.mm_input_projection_weight", permute_dims=(1, 0)),
            column_parallel_module,
            (4, HIDDEN + 3),
            "transpose",
        ),
        "transposed-replicated": (
            AutoMapping("vision_model.proj.weight", "v.proj", permute_dims=(1, 0)),
            replicated_module,
            (HIDDEN + 3, 5),
            "transpose",
        ),
        # Ernie 4.5's expert bias: [N] -> [1, N] on export
        "unsqueezed-bias": (
            _SqueezeBiasMapping(
                "decoder.layers.1.mlp.router.expert_bias", "l.1.mlp.moe_statics.e_score_correction_bias"
            ),
            replicated_module,
            (8,),
            "unsqueeze0",
        ),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("case", ["transposed-column", "transposed-replicated", "unsqueezed-bias"])
def test_relaid_tensors_rebuild_upstream_export(case, tp, monkeypatch):
    """A mapping that re-lays its base class's whole tensor out (``conversions.RELAYOUTS``): every
    rank's slices rebuild the tensor before the relayout, and the relayout of it is upstream's
    export bit for bit, shape included; its load view gives back the rebuilt tensor."""
    from mbridge_refit.plan.conversions import RELAYOUTS

    mapping, module_of, shape, relayout = _relayout_cases()[case]
    config = types.SimpleNamespace(hidden_size=HIDDEN)
    if module_of is replicated_module and tp > 1:
        pytest.skip("a replicated tensor is whole on every rank: tp=1 says it all")
    fake = FakeTensorParallel((shape[0] * tp, *shape[1:]), tp)
    module = module_of(config)
    upstream = upstream_export(mapping, fake, config, tp, monkeypatch, module)
    ((name, exported),) = upstream.items()
    base = {name: RELAYOUTS[relayout].load(exported)}
    kind, rebuilt, writes = rebuilt_from_slices(mapping, fake, config, tp, base, module=module)
    assert kind.relayout == relayout
    assert torch.equal(writes[name], torch.ones_like(writes[name]))
    relaid = RELAYOUTS[relayout].export(rebuilt[name])
    assert relaid.shape == exported.shape and RELAYOUTS[relayout].export_shape(tuple(rebuilt[name].shape)) == tuple(
        exported.shape
    )
    assert torch.equal(relaid, exported)


def test_a_missing_relayout_is_caught():
    """Without its relayout the projector's rebuilt tensor is not upstream's (the shapes differ)."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    mapping = AutoMapping("multi_modal_projector.proj.weight", "m.w", permute_dims=(1, 0))
    plain = AutoMapping("multi_modal_projector.proj.weight", "m.w")
    fake = FakeTensorParallel((4, HIDDEN + 3), 1)
    config = types.SimpleNamespace(hidden_size=HIDDEN)
    with pytest.MonkeyPatch.context() as monkeypatch:
        transposed = upstream_export(mapping, fake, config, 1, monkeypatch)["m.w"]
        as_stored = upstream_export(plain, fake, config, 1, monkeypatch)["m.w"]
    assert transposed.shape != as_stored.shape


def test_permutations_other_than_a_transpose_and_unknown_overrides_are_refused():
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, ReplicatedMapping

    from mbridge_refit.plan.placement import placement_kind
    from mbridge_refit.plan.slices import PlacementError

    config = types.SimpleNamespace(hidden_size=HIDDEN)
    with pytest.raises(PlacementError, match=r"permute_dims=\(0, 2, 1\)"):
        placement_kind(AutoMapping("a.weight", "h.a", permute_dims=(0, 2, 1)), column_parallel_module(config))

    class Doubling(ReplicatedMapping):  # an override with no rule: it may change data or shape
        def megatron_to_hf(self, megatron_weights, megatron_module):
            return {k: v * 2 for k, v in super().megatron_to_hf(megatron_weights, megatron_module).items()}

    with pytest.raises(PlacementError, match="Doubling, which overrides ReplicatedMapping.megatron_to_hf"):
        placement_kind(Doubling("decoder.layers.0.mlp.router.expert_bias", "h.bias"), replicated_module(config))


def _projector_entry(relayout: str | None):
    from mbridge_refit.plan.entries import PlanEntry, TensorSharding
    from mbridge_refit.plan.slices import SliceCopy

    name = "multi_modal_projector.mm_input_projection_weight"
    piece = SliceCopy(hf_name=name, dim=0, hf_start=0, hf_stop=4, local_start=0)
    sharding = TensorSharding(
        mesh_dims=("tp", "dp"),
        mesh_shape=(1, 1),
        placements=("Replicate()", "Replicate()"),
        pieces=((piece,),),
        local_shape=(4, 6),
    )
    return PlanEntry(
        hf_name=name,
        shape=(6, 4) if relayout else (4, 6),
        dtype="bfloat16",
        megatron_param="multi_modal_projector.proj.weight",
        pp_rank=0,
        vpp_stage=0,
        is_expert=False,
        kind="replicated",
        sharding=sharding,
        relayout=relayout,
    )


def test_a_relaid_entry_is_built_as_its_base_in_a_buffer_and_round_trips_as_json():
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.runtime.collectives import ParallelGroups
    from mbridge_refit.runtime.schedule import AssemblyKind, base_entry, plan_assembly

    groups = ParallelGroups(tp=None, ep=None, pp=None, tp_size=1, ep_size=1, pp_size=1, pp_rank=0, ep_rank=0, tp_rank=0)
    assert plan_assembly(_projector_entry(None), groups).kind is AssemblyKind.VIEW  # control
    relaid = _projector_entry("transpose")
    assert plan_assembly(relaid, groups).kind is AssemblyKind.PIECES  # its own buffer: never a view of the parameter
    assert relaid.base_shape == (4, 6) and base_entry(relaid).shape == (4, 6) and base_entry(relaid).relayout is None
    plan = ExportPlan(entries=(relaid,), layer_map={0: (0, 0)}, tp=1, pp=1, ep=1, vpp=1)
    assert ExportPlan.from_json(plan.to_json()) == plan


def test_the_sharded_transfer_refuses_a_relaid_entry():
    from mbridge_refit.plan.transfer import TransferPlanError, _check_plannable

    _check_plannable(_projector_entry(None))  # control
    with pytest.raises(TransferPlanError, match=r"mm_input_projection_weight.*'transpose'.*packed broadcast"):
        _check_plannable(_projector_entry("transpose"))
