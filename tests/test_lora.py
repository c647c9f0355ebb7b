"""LoRA refit (issue #33): merged export on the plan and adapter-only export, against stock.

Multi-rank cases run tests/ranks/lora_check.py on CPU ranks (gloo): a tiny Qwen3 / Qwen3-MoE built
from its checkpoint, wrapped with Megatron-Bridge's own ``LoRA``, adapters random; the oracle is a
plain ``AutoBridge``'s merged export and adapter export of the same model. Unit cases check the
merge arithmetic against Megatron-Bridge's ``LoRAMerge`` and the plan's name and fact rules.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, torchrun
from test_roundtrip import layout_flags

from mbridge_refit.plan.lora import FACTOR_KINDS, AdapterTarget, LoraPlan, lora_name
from mbridge_refit.runtime.buffers import ExportBuffers
from mbridge_refit.runtime.lora import merge_adapter

CHECKER = str(REPO / "tests" / "ranks" / "lora_check.py")
EXPERT_FALLBACK = "expert adapters at ep=2"

# (recipe, layout, extra flags): every target module unless --targets says otherwise.
CASES = [
    ("qwen3-tiny", "tp1", []),
    ("qwen3-tiny", "tp2", []),
    ("qwen3-tiny", "pp2", []),
    ("qwen3-moe-tiny", "tp1", []),  # adapters on every expert's fc1 and fc2
    ("qwen3-moe-tiny", "ep2", ["--targets", "linear_qkv,linear_proj"]),
    ("qwen3-moe-tiny", "ep2", ["--expect-fallback", EXPERT_FALLBACK]),  # expert adapters at EP2: stock, named
]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("recipe", "layout", "extra"),
    CASES,
    ids=[f"{r}-{layout}{'-' + e[0].strip('-') if e else ''}" for r, layout, e in CASES],
)
def test_lora_refit_matches_stock(recipe, layout, extra, source_checkpoints, tmp_path):
    nproc, flags = layout_flags(layout)
    command = [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags, *extra]
    run = torchrun(nproc, command)
    verdicts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    failed = {f"rank{r}:{name}": v for r, checks in enumerate(verdicts) for name, v in checks.items() if v}
    assert not failed, failed
    assert run.returncode == 0, run.output[-6000:]
    assert all(len(checks) == 8 for checks in verdicts), verdicts


@pytest.mark.multirank
def test_replaced_adapter_factors_are_read_and_a_changed_dtype_refused(source_checkpoints, tmp_path):
    """Factors the model replaced after the plan was built are the ones the merged and the adapter
    export read (equal to stock's of the changed model), after ``release_export_buffers`` too; a
    factor whose dtype changed in place is refused by name (one CPU rank, tests/ranks/lora_check.py)."""
    command = [CHECKER, "--hf", str(source_checkpoints("qwen3-tiny")), "--result", str(tmp_path)]
    run = torchrun(1, [*command, "--checks", "factors_replaced"])
    verdicts = json.loads((tmp_path / "rank0.json").read_text())
    assert verdicts == {"factors_replaced": None}, verdicts
    assert run.returncode == 0, run.output[-6000:]


def _stock_merge(base, a, b, alpha, dim):
    """Megatron-Bridge's merge of one adapter, as its merged export calls it."""
    from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge

    return MegatronPeftBridge()._merge_single_adapter_weight(base, alpha, dim, a, b)


@pytest.mark.parametrize(("out", "inp", "r", "alpha"), [(64, 64, 4, 8), (96, 48, 8, 16), (33, 17, 3, 7)])
def test_merge_is_stocks_bit_for_bit(out, inp, r, alpha):
    generator = torch.Generator().manual_seed(out * inp + r)
    base = torch.randn(out, inp, generator=generator).to(torch.bfloat16)
    a = (torch.randn(r, inp, generator=generator) * 0.1).to(torch.bfloat16)
    b = (torch.randn(out, r, generator=generator) * 0.1).to(torch.bfloat16)
    buffers = ExportBuffers(persistent=True)
    merged = merge_adapter(torch.empty_like(base), base, a, b, alpha / r, buffers)
    expected = _stock_merge(base, a, b, alpha, r)
    assert torch.equal(merged.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(merged, base)
    # a second merge reuses the scratch: nothing allocated
    allocations = buffers.allocations
    merge_adapter(torch.empty_like(base), base, a, b, alpha / r, buffers)
    assert buffers.allocations == allocations


def test_a_wrong_scale_is_caught():
    """The comparison above can fail: the scale applied after rounding, or a fused addmm, differ from stock."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=generator).to(torch.bfloat16)
    a = (torch.randn(4, 64, generator=generator) * 0.1).to(torch.bfloat16)
    b = (torch.randn(64, 4, generator=generator) * 0.1).to(torch.bfloat16)
    expected = _stock_merge(base, a, b, 8, 4)
    wrong = merge_adapter(torch.empty_like(base), base, a, b, 8 / 4 + 1e-3, ExportBuffers(persistent=False))
    assert not torch.equal(wrong, expected)


def test_peft_names_and_facts():
    assert lora_name("model.layers.0.self_attn.q_proj.weight", "A") == "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora_name("model.layers.0.mlp.up_proj.weight", "B") == "model.layers.0.mlp.up_proj.lora_B.weight"
    assert FACTOR_KINDS["row"] == "column"  # B of a row-parallel weight is split over its output rows

    def target(base, dim=4, alpha=8):
        return AdapterTarget(
            base=base,
            lora_a=lora_name(base, "A"),
            lora_b=lora_name(base, "B"),
            a_entry=lora_name(base, "A"),
            adapter=base,
            alpha=alpha,
            dim=dim,
        )

    plan = LoraPlan(
        plan=None,
        targets=(
            target("model.layers.0.self_attn.q_proj.weight"),
            target("model.layers.0.mlp.down_proj.weight"),
            target("model.layers.1.mlp.down_proj.weight", dim=8, alpha=4),
        ),
    )
    assert plan.facts() == {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["down_proj", "q_proj"],
        "rank_pattern": {"model.layers.1.mlp.down_proj": 8},
        "alpha_pattern": {"model.layers.1.mlp.down_proj": 4},
    }
    assert plan.targets[0].scale == 2.0
