"""HFModelUpdateSink: a stream applied in place to a live transformers model (single process).

The stream is the source checkpoint read by the independent oracle (tests/oracle.py); the
expected result is the same checkpoint loaded by ``from_pretrained``. The end-to-end variant,
a real multi-rank export received over the packed broadcast and applied with this sink, runs in
tests/ranks/packed_broadcast_check.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from oracle import read_checkpoint

from mbridge_refit.sinks import drain
from mbridge_refit.sinks.model_update import FUSED_TENSOR_RULES, HFModelUpdateSink, WeightUpdateError


def _fresh_model(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)


def _loaded_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("recipe", ["qwen3-tiny", "qwen3-moe-tiny", "llama-tied-tiny"])
def test_stream_equals_from_pretrained(recipe, source_checkpoints):
    path = source_checkpoints(recipe)
    stream = read_checkpoint(path)
    model = _fresh_model(path)
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    assert drain(stream.items(), HFModelUpdateSink(model)) == len(stream)
    after, want = model.state_dict(), _loaded_model(path).state_dict()
    assert sorted(after) == sorted(want)
    differing = [name for name in want if not _same(after[name], want[name])]
    assert not differing, f"differ from from_pretrained: {differing}"
    assert {name: t.data_ptr() for name, t in after.items()} == pointers, "a tensor was re-allocated"
    if recipe == "qwen3-moe-tiny":  # the fused layout really is exercised
        assert "model.layers.0.mlp.experts.gate_up_proj" in after
    if recipe == "llama-tied-tiny":
        assert after["lm_head.weight"].data_ptr() == after["model.embed_tokens.weight"].data_ptr()


def test_fused_expert_orientation(source_checkpoints):
    """gate_proj -> gate_up_proj[e, :I], up_proj -> gate_up_proj[e, I:], down_proj -> down_proj[e]."""
    path = source_checkpoints("qwen3-moe-tiny")
    stream = read_checkpoint(path)
    model = _fresh_model(path)
    drain(stream.items(), HFModelUpdateSink(model))
    experts = model.model.layers[2].mlp.experts
    inter = experts.down_proj.shape[-1]
    base = "model.layers.2.mlp.experts.3"
    assert torch.equal(experts.gate_up_proj[3, :inter], stream[f"{base}.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[3, inter:], stream[f"{base}.up_proj.weight"])
    assert torch.equal(experts.down_proj[3], stream[f"{base}.down_proj.weight"])
    assert {row.target for row in FUSED_TENSOR_RULES} == {"{experts}.gate_up_proj", "{experts}.down_proj"}


def test_tied_stream_without_lm_head(source_checkpoints):
    path = source_checkpoints("llama-tied-tiny")
    stream = {k: v for k, v in read_checkpoint(path).items() if k != "lm_head.weight"}
    model = _fresh_model(path)
    drain(stream.items(), HFModelUpdateSink(model))
    assert torch.equal(model.lm_head.weight, stream["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("recipe", "dropped"),
    [
        ("qwen3-tiny", "model.layers.1.self_attn.k_norm.weight"),
        ("qwen3-moe-tiny", "model.layers.1.mlp.experts.2.up_proj.weight"),
    ],
)
def test_missing_name_is_named(recipe, dropped, source_checkpoints):
    path = source_checkpoints(recipe)
    stream = read_checkpoint(path)
    del stream[dropped]
    with pytest.raises(WeightUpdateError, match=r"1 missing \['" + dropped.replace(".", r"\.") + r"'\]"):
        drain(stream.items(), HFModelUpdateSink(_fresh_model(path)))


def test_unknown_name_is_named(source_checkpoints):
    path = source_checkpoints("qwen3-moe-tiny")
    stream = read_checkpoint(path)
    stream["model.layers.0.mlp.experts.9.gate_proj.weight"] = stream["model.layers.0.mlp.experts.0.gate_proj.weight"]
    stream["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
    with pytest.raises(
        WeightUpdateError,
        match=r"2 unexpected \['model\.layers\.0\.mlp\.bogus\.weight', 'model\.layers\.0\.mlp\.experts\.9\.gate_proj\.weight'\]",
    ):
        drain(stream.items(), HFModelUpdateSink(_fresh_model(path)))


def test_not_strict_warns(source_checkpoints, caplog):
    path = source_checkpoints("qwen3-tiny")
    stream = read_checkpoint(path)
    del stream["model.norm.weight"]
    with caplog.at_level(logging.WARNING, logger="mbridge_refit.sinks.model_update"):
        drain(stream.items(), HFModelUpdateSink(_fresh_model(path), strict=False))
    assert "model.norm.weight" in caplog.text


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("model.layers.0.self_attn.q_proj.weight", lambda t: t[:-1], r"q_proj\.weight: stream tensor \[63, 64\]"),
        (
            "model.layers.0.mlp.experts.1.up_proj.weight",
            lambda t: t.float(),
            r"experts\.1\.up_proj\.weight: .*torch\.float32.*\[expert 1, part 1\]",
        ),
    ],
    ids=["shape", "dtype-fused"],
)
def test_shape_and_dtype_mismatch(name, change, message, source_checkpoints):
    path = source_checkpoints("qwen3-moe-tiny")
    stream = read_checkpoint(path)
    stream[name] = change(stream[name])
    with pytest.raises(WeightUpdateError, match=message):
        drain(stream.items(), HFModelUpdateSink(_fresh_model(path)))


def test_duplicate_name_raises(source_checkpoints):
    path = source_checkpoints("qwen3-tiny")
    stream = list(read_checkpoint(path).items())
    with pytest.raises(WeightUpdateError, match="model.norm.weight was written twice"):
        drain(
            [*stream, ("model.norm.weight", dict(stream)["model.norm.weight"])], HFModelUpdateSink(_fresh_model(path))
        )


def test_tied_stream_with_both_names(source_checkpoints):
    """Exports of tied models built from a config yield lm_head.weight too: same bytes, one tensor."""
    path = source_checkpoints("llama-tied-tiny")
    stream = read_checkpoint(path)
    assert "lm_head.weight" not in stream
    embed = stream["model.embed_tokens.weight"]
    model = _fresh_model(path)
    assert drain([*stream.items(), ("lm_head.weight", embed.clone())], HFModelUpdateSink(model)) == len(stream) + 1
    assert torch.equal(model.lm_head.weight, embed)
    changed = embed.clone()
    changed[0, 0] += 1
    with pytest.raises(WeightUpdateError, match="lm_head.weight and model.embed_tokens.weight are one tied tensor"):
        drain([*stream.items(), ("lm_head.weight", changed)], HFModelUpdateSink(_fresh_model(path)))
