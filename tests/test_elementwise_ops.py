"""Mappings whose conversion is their base class's slices plus an elementwise op
(``placement.elementwise_op_rules``): the op named for each is bitwise the mapping's own
conversion, both ways, on random BF16 values; the exporter never hands out such a tensor as a
view of the parameter; the sharded transfer refuses it by name."""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.plan.conversions import ELEMENTWISE_OPS
from mbridge_refit.plan.placement import placement_kind
from mbridge_refit.plan.slices import PlacementError

NORM = "decoder.layers.0.self_attention.out_norm.weight"
HF_NORM = "model.layers.0.linear_attn.norm.weight"


class RMSNorm(torch.nn.Module):
    """A module the bridge reads as a replicated norm (by its type name)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size, dtype=torch.bfloat16))


@pytest.fixture
def single_rank(monkeypatch):
    """Upstream mappings as on the only rank (tensor- and pipeline-parallel size 1)."""
    from megatron.bridge.models.conversion import param_mapping as pm

    for name, value in (("tp_size", 1), ("tp_rank", 0), ("pp_size", 1), ("pp_rank", 0)):
        monkeypatch.setattr(pm.MegatronParamMapping, name, property(lambda self, value=value: value))


def _random_bf16(size: int, seed: int) -> torch.Tensor:
    # zero-centred weights around 0, with magnitudes where adding 1 rounds in BF16
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, generator=generator) * torch.logspace(-4, 1, size)).to(torch.bfloat16)


def _zero_centred_mapping():
    from megatron.bridge.models.conversion.param_mapping import RMSNorm2ZeroCenteredRMSNormMapping

    return RMSNorm2ZeroCenteredRMSNormMapping(NORM, HF_NORM)


def test_zero_centred_norm_op_is_the_mappings_own_conversion(single_rank):
    mapping, module = _zero_centred_mapping(), RMSNorm(512)
    kind = placement_kind(mapping, module)
    assert (kind.kind, kind.hf_names, kind.elementwise_op) == ("replicated", (HF_NORM,), "add_one")
    weight = _random_bf16(512, seed=0)
    kept = weight.clone()
    ((name, expected),) = mapping.megatron_to_hf(weight, module).items()
    ours = weight.clone()
    ELEMENTWISE_OPS[kind.elementwise_op].export(ours)
    assert name == HF_NORM and ours.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(weight.view(torch.int16), expected.view(torch.int16))  # no op: caught
    assert torch.equal(weight.view(torch.int16), kept.view(torch.int16))  # stock leaves the parameter alone

    checkpoint = _random_bf16(512, seed=1) + 1
    loaded = mapping.hf_to_megatron(checkpoint, module)
    ours = checkpoint.clone()
    ELEMENTWISE_OPS[kind.elementwise_op].load(ours)
    assert torch.equal(ours.view(torch.int16), loaded.to(torch.bfloat16).view(torch.int16))


def test_a_subclass_of_an_op_mapping_that_converts_again_is_refused():
    from megatron.bridge.models.conversion.param_mapping import RMSNorm2ZeroCenteredRMSNormMapping

    class Doubling(RMSNorm2ZeroCenteredRMSNormMapping):
        def megatron_to_hf(self, megatron_weights, megatron_module):
            return {k: v * 2 for k, v in super().megatron_to_hf(megatron_weights, megatron_module).items()}

    with pytest.raises(PlacementError, match=r"out_norm.*Doubling.*overrides AutoMapping\.megatron_to_hf"):
        placement_kind(Doubling(NORM, HF_NORM), RMSNorm(8))


def _norm_entry(op: str | None):
    from mbridge_refit.plan.entries import PlanEntry, TensorSharding
    from mbridge_refit.plan.slices import SliceCopy

    piece = SliceCopy(hf_name=HF_NORM, dim=0, hf_start=0, hf_stop=8, local_start=0)
    sharding = TensorSharding(
        mesh_dims=("tp", "dp"),
        mesh_shape=(1, 1),
        placements=("Replicate()", "Replicate()"),
        pieces=((piece,),),
        local_shape=(8,),
    )
    return PlanEntry(
        hf_name=HF_NORM,
        shape=(8,),
        dtype="bfloat16",
        megatron_param=NORM,
        pp_rank=0,
        vpp_stage=0,
        is_expert=False,
        kind="replicated",
        sharding=sharding,
        elementwise_op=op,
    )


def test_an_entry_with_an_op_is_built_in_a_buffer_and_round_trips_as_json():
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.runtime.collectives import ParallelGroups
    from mbridge_refit.runtime.schedule import AssemblyKind, plan_assembly

    groups = ParallelGroups(tp=None, ep=None, pp=None, tp_size=1, ep_size=1, pp_size=1, pp_rank=0, ep_rank=0, tp_rank=0)
    assert plan_assembly(_norm_entry(None), groups).kind is AssemblyKind.VIEW  # control
    assert plan_assembly(_norm_entry("add_one"), groups).kind is AssemblyKind.PIECES
    plan = ExportPlan(entries=(_norm_entry("add_one"),), layer_map={0: (0, 0)}, tp=1, pp=1, ep=1, vpp=1)
    assert ExportPlan.from_json(plan.to_json()) == plan


def test_the_sharded_transfer_refuses_an_entry_with_an_op():
    from mbridge_refit.plan.transfer import TransferPlanError, _check_plannable

    _check_plannable(_norm_entry(None))  # control
    with pytest.raises(TransferPlanError, match=r"linear_attn\.norm\.weight.*'add_one'.*packed broadcast"):
        _check_plannable(_norm_entry("add_one"))


def test_the_loader_applies_the_inverse_op_as_the_mapping_does(single_rank, tmp_path):
    """The CPU loader reads the norm from a checkpoint on disk; the parameter must hold what the
    mapping's own ``hf_to_megatron`` makes of the same tensor."""
    from safetensors.torch import save_file

    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.checkpoints.loader import LoadReport, _copy_slices
    from mbridge_refit.plan.slices import ShardContext, slices_for

    mapping, module = _zero_centred_mapping(), RMSNorm(512)
    stored = _random_bf16(512, seed=2) + 1
    save_file({HF_NORM: stored}, str(tmp_path / "model.safetensors"))
    kind = placement_kind(mapping, module)
    copies = slices_for(kind, ShardContext(local_shape=(512,), tp_rank=0, tp_size=1, config=None))
    param = torch.empty(512, dtype=torch.bfloat16)
    _copy_slices(
        param, copies, {HF_NORM: (0, 512)}, HFCheckpoint.open(tmp_path), LoadReport(), NORM, kind.elementwise_op
    )
    expected = mapping.hf_to_megatron(stored, module).to(torch.bfloat16)
    assert torch.equal(param.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(stored.view(torch.int16), expected.view(torch.int16))  # no inverse: caught


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_next_cached_export_applies_the_op_once_and_leaves_the_norms_alone(tp, tmp_path):
    """Tiny Qwen3-Next on ``tp`` CPU ranks: two cached exports equal stock, the norm parameters
    are unchanged, ``live_rows`` names no tensor with an op (``ranks/elementwise_op_export_check.py``)."""
    import json
    from pathlib import Path

    from conftest import REPO, torchrun

    result = tmp_path / "op.json"
    run = torchrun(
        tp, [str(REPO / "tests" / "ranks" / "elementwise_op_export_check.py"), "--tp", str(tp), "--result", str(result)]
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads(Path(f"{result}.rank{rank}").read_text()) for rank in range(tp)]
    assert all(r["with_op"] > 0 for r in reports)
    assert [r["failures"] for r in reports] == [[]] * tp
