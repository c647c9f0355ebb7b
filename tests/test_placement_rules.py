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
    (4, 2, 8), (8, 4, 4), (16, 4, 8), (8, 8, 4),
]
GDN = [  # (key heads, value heads, key head dim, value head dim)
    (4, 8, 8, 4), (4, 4, 8, 8), (8, 16, 4, 8), (4, 12, 4, 4),
]
MAMBA = [  # (heads, head dim, groups, state size)
    (8, 4, 2, 4), (4, 8, 1, 8), (8, 2, 8, 2), (12, 2, 4, 4),
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


def upstream_export(mapping, fake: FakeTensorParallel, config, tp: int, monkeypatch, module=None) -> dict[str, torch.Tensor]:
    """``mapping.megatron_to_hf`` on rank 0 of ``tp`` ranks (pipeline size 1)."""
    from megatron.bridge.models.conversion import param_mapping as pm

    monkeypatch.setattr(pm.MegatronParamMapping, "tp_size", property(lambda self: tp))
    monkeypatch.setattr(pm.MegatronParamMapping, "tp_rank", property(lambda self: fake.rank))
    monkeypatch.setattr(pm.MegatronParamMapping, "pp_size", property(lambda self: 1))
    monkeypatch.setattr(pm.MegatronParamMapping, "gather_from_tp_ranks", lambda _, tensor: fake.gather(tensor))
    module = module or column_parallel_module(config)
    fake.rank = 0
    return mapping.megatron_to_hf(fake.shards[0], module)


def rebuilt_from_slices(mapping, fake: FakeTensorParallel, config, tp: int, reference: dict[str, torch.Tensor], model_config=None, module=None):
    """The HF tensors rebuilt from every rank's ``slice_copies``, and how often each element was written.
    ``config``: the layer module's; ``model_config``: the model's (the plan's ``ShardContext``), default the same."""
    from mbridge_refit.plan.placement import ShardContext, check_tiling, placement_kind, slices_for

    kind = placement_kind(mapping, module or column_parallel_module(config))
    rebuilt = {name: torch.full_like(t, float("nan")) for name, t in reference.items()}
    writes = {name: torch.zeros(t.shape[0], dtype=torch.int64) for name, t in reference.items()}
    for rank, shard in enumerate(fake.shards):
        ctx = ShardContext(local_shape=tuple(shard.shape), tp_rank=rank, tp_size=tp, config=model_config or config)
        copies = slices_for(kind, ctx)
        check_tiling(mapping.megatron_param, ctx.local_shape, copies)
        for copy in copies:
            assert copy.dim == 0
            rebuilt[copy.hf_name][copy.hf_start : copy.hf_stop] = shard[copy.local_start : copy.local_start + copy.length]
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
        hidden_size=HIDDEN, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim, linear_value_head_dim=value_dim,
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
        hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
        attention_output_gate=True,
    )
    suffix = "bias" if bias else "weight"
    mapping = QKVMapping(f"decoder.layers.0.self_attention.linear_qkv.{suffix}", *(f"l.0.{p}_proj.{suffix}" for p in "qkv"))
    rows = (2 * heads + 2 * groups) * head_dim
    assert_rebuilds(mapping, (rows,) if bias else (rows, HIDDEN), config, tp, monkeypatch, "qkv_gated")


LAYER_HEADS = [  # (model's query groups, head dim; the layer's query groups, head dim), 4 query heads
    (2, 8, 2, 32), (2, 8, 4, 16), (4, 16, 2, 8),
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
        return types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=query_groups,
                                     kv_channels=size, attention_output_gate=gated)

    mapping = QKVMapping("decoder.layers.3.self_attention.linear_qkv.weight", *(f"l.3.{p}_proj.weight" for p in "qkv"))
    rows = ((2 if gated else 1) * 4 + 2 * groups) * head_dim
    assert_rebuilds(mapping, (rows, HIDDEN), heads(groups, head_dim), tp, monkeypatch, "qkv_gated" if gated else "qkv",
                    model_config=heads(model_groups, model_head_dim))


CONCATENATED_QKV = [  # (attention heads, query groups, head dim): a vision tower's MHA, and GQA
    (4, 4, 8), (8, 2, 4), (16, 4, 8),
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

    config = types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim)
    language = types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=32, num_query_groups=8, kv_channels=2)
    suffix = "bias" if bias else "weight"
    mapping = ConcatenatedQKVMapping(f"vision_model.decoder.layers.0.self_attention.linear_qkv.{suffix}", f"v.blocks.0.attn.qkv.{suffix}")
    rows = (heads + 2 * groups) * head_dim
    assert_rebuilds(mapping, (rows,) if bias else (rows, HIDDEN), config, tp, monkeypatch, "qkv_concatenated", model_config=language)


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

    from mbridge_refit.plan.placement import PlacementError, placement_kind

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

    mapping = GDNLinearMapping("decoder.layers.0.self_attention.in_proj.weight", "l.0.in_proj_qkvz.weight", "l.0.in_proj_ba.weight")
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
    assert_rebuilds(mapping, (gdn_in_proj_rows(*dims), HIDDEN), gdn_config(*dims), tp, monkeypatch, "gdn_in_proj_separate")


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
    assert_rebuilds(mapping, (channels,) if bias else (channels, 1, 4), gdn_config(*dims), tp, monkeypatch, "gdn_conv1d")


def mamba_config(heads, head_dim, groups, state):
    return types.SimpleNamespace(
        hidden_size=HIDDEN, mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_state_dim=state,
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
    assert_rebuilds(mapping, (channels,) if bias else (channels, 1, 4), mamba_config(*dims), tp, monkeypatch, "mamba_conv1d")


def test_a_mamba_mixer_without_a_head_count_is_refused():
    from mbridge_refit.plan.placement import PlacementError, PlacementKind, ShardContext, slices_for

    config = types.SimpleNamespace(**{**vars(mamba_config(8, 4, 2, 4)), "mamba_num_heads": None})
    ctx = ShardContext(local_shape=(80, HIDDEN), tp_rank=0, tp_size=1, config=config)
    with pytest.raises(PlacementError, match="mamba_num_heads"):
        slices_for(PlacementKind(kind="mamba_in_proj", hf_names=("l.0.mixer.in_proj.weight",)), ctx)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_pp_safe_gated_mlp_slices_rebuild_upstream_split(tp, monkeypatch):
    """Ernie 4.5's ``_PPSafeGatedMLPMapping`` exports as ``GatedMLPMapping`` for a parameter a rank
    holds (its override only turns "no stage holds it" into ``{}``); its expert-bias mapping, which
    reshapes on export, stays refused."""
    from megatron.bridge.models.ernie.ernie_45_bridge import _PPSafeGatedMLPMapping, _SqueezeBiasMapping

    from mbridge_refit.plan.placement import PlacementError, placement_kind

    config = types.SimpleNamespace(hidden_size=HIDDEN)
    mapping = _PPSafeGatedMLPMapping("decoder.layers.0.mlp.linear_fc1.weight", "l.0.mlp.gate_proj.weight", "l.0.mlp.up_proj.weight")
    assert_rebuilds(mapping, (8 * tp, HIDDEN), config, tp, monkeypatch, "gated")
    squeeze = _SqueezeBiasMapping("decoder.layers.1.mlp.router.expert_bias", "l.1.mlp.moe_statics.e_score_correction_bias")
    with pytest.raises(PlacementError, match="_SqueezeBiasMapping, which overrides ReplicatedMapping.megatron_to_hf"):
        placement_kind(squeeze, column_parallel_module(config))
