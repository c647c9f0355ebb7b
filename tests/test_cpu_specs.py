"""CPU stand-ins for Transformer Engine modules (``mbridge_refit/models/cpu_stand_ins.py``, ``cpu_specs.py``) and the CPU
materialisation of a model (``models.builder.keeping_parameter_attributes``).

What a whole family's CPU build holds is checked by the conformance matrix (tests/test_conformance.py:
stock's export of the same model, every parameter mapped); here, the parts: a Transformer Engine
norm built as its stand-in has Transformer Engine's parameters and computes its norm, a Transformer
Engine class with no stand-in is refused by name, the classes are as they were after the build;
the grouped linears' shapes and attributes against Megatron's own ``_set_expert_parameter_attributes``
(what ``TEGroupedLinear`` runs on its parameters); and a parameter keeps Megatron's marks when the model leaves the meta device.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from megatron.core.extensions import transformer_engine as te
from megatron.core.transformer.transformer_config import TransformerConfig
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

from mbridge_refit.models import cpu_specs, cpu_stand_ins
from mbridge_refit.models.builder import keeping_parameter_attributes

ATTRIBUTES = ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride")


def _config(normalization: str, zero_centered_gamma: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        normalization=normalization,
        layernorm_zero_centered_gamma=zero_centered_gamma,
        params_dtype=torch.bfloat16,
    )


@pytest.mark.parametrize(
    ("normalization", "zero_centered_gamma", "names"),
    [
        ("RMSNorm", True, ["weight"]),
        ("RMSNorm", False, ["weight"]),
        ("LayerNorm", False, ["weight", "bias"]),
    ],
)
def test_te_norm_is_built_as_a_norm_with_its_parameters(normalization, zero_centered_gamma, names):
    """TENorm inside the build context: Transformer Engine's parameter names, shape and dtype, and
    the norm it computes (``1 + weight`` when zero-centered) against torch's own functional norm."""
    config = _config(normalization, zero_centered_gamma)
    with cpu_specs.te_modules_built_local():
        norm = te.TENorm(config, 16, eps=1e-6)
    assert isinstance(norm, cpu_stand_ins.TorchNorm)
    assert [(n, tuple(p.shape), p.dtype) for n, p in norm.named_parameters()] == [
        (n, (16,), torch.bfloat16) for n in names
    ]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    x = torch.randn(3, 16, generator=generator, dtype=torch.bfloat16)
    gamma = norm.weight + 1 if zero_centered_gamma else norm.weight
    if normalization == "LayerNorm":
        expected = torch.nn.functional.layer_norm(x, (16,), gamma, norm.bias, 1e-6)
    else:
        expected = torch.nn.functional.rms_norm(x, (16,), gamma, 1e-6)
    assert torch.equal(norm(x), expected)


def test_te_classes_are_as_they_were_after_the_build():
    te_norm_new = te.TENorm.__dict__["__new__"]
    with cpu_specs.te_modules_built_local():
        assert TransformerEngineBaseModule.__dict__.get("__new__") is not None
    assert te.TENorm.__dict__["__new__"] is te_norm_new
    assert "__new__" not in TransformerEngineBaseModule.__dict__
    assert "__new__" not in te.TELayerNormColumnParallelLinear.__dict__


def test_a_te_class_without_a_stand_in_is_refused_by_name():
    """A subclass adds what its base lacks (Megatron-Bridge's post-norm linear adds a norm): it is
    never built as its base's stand-in, and the error names it and where a stand-in goes."""

    class PostNormLinear(te.TERowParallelLinear):
        pass

    config = _config("RMSNorm", False)
    with (
        cpu_specs.te_modules_built_local(),
        pytest.raises(NotImplementedError, match="PostNormLinear.*te_subclass_stand_ins"),
    ):
        PostNormLinear(
            16,
            16,
            config=config,
            init_method=None,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
        )


def test_parameters_keep_their_marks_off_the_meta_device():
    """``to_empty`` from the meta device makes new parameters; Megatron's marks (tensor parallel,
    partition dim, expert parallel) come back, and the bare conversion would have dropped them."""
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    module[0].weight.tensor_model_parallel, module[0].weight.partition_dim = True, 0
    module[1].weight.allreduce = False
    kept = keeping_parameter_attributes(module, lambda m: m.to_empty(device="cpu"))
    assert kept[0].weight.device.type == "cpu"
    assert (kept[0].weight.tensor_model_parallel, kept[0].weight.partition_dim, kept[1].weight.allreduce) == (
        True,
        0,
        False,
    )
    with torch.device("meta"):
        bare = torch.nn.Linear(4, 8)
    bare.weight.tensor_model_parallel = True
    assert not hasattr(bare.to_empty(device="cpu").weight, "tensor_model_parallel")


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _expert_config(*, ep: int, etp: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        tensor_model_parallel_size=tp,
        params_dtype=torch.bfloat16,
        perform_initialization=False,
    )


def _megatron_attributes(module: torch.nn.Module, parallel_mode: str, use_expert_pgs: bool) -> dict:
    """The attributes Megatron's ``TEGroupedLinear`` sets on parameters like ``module``'s."""
    from megatron.core.extensions.transformer_engine import (
        _set_expert_parameter_attributes,
    )

    reference = torch.nn.Module()
    for name, param in module.named_parameters(recurse=False):
        reference.register_parameter(name, torch.nn.Parameter(torch.empty_like(param)))
    _set_expert_parameter_attributes(reference, parallel_mode, use_expert_pgs)
    return {name: {a: getattr(p, a, None) for a in ATTRIBUTES} for name, p in reference.named_parameters()}


@pytest.mark.parametrize(
    ("stand_in", "parallel_mode"),
    [
        (cpu_stand_ins.ColumnParallelGroupedLinear, "column"),
        (cpu_stand_ins.RowParallelGroupedLinear, "row"),
    ],
)
@pytest.mark.parametrize(("ep", "etp", "tp"), [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 1, 2)])
def test_grouped_linear_stand_ins_carry_megatrons_expert_attributes(stand_in, parallel_mode, ep, etp, tp, monkeypatch):
    """``weight0..N-1`` (and biases) with TE's per-rank shapes and Megatron's expert attributes."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # get_pg_size reads the group
    config = _expert_config(ep=ep, etp=etp, tp=tp)
    module = stand_in(
        3,
        8,
        12,
        config=config,
        init_method=None,
        bias=True,
        skip_bias_add=False,
        is_expert=True,
        pg_collection=SimpleNamespace(expt_tp=_Group(etp)),
    )
    names = [f"{kind}{i}" for i, kind in itertools.product(range(3), ("weight", "bias"))]
    assert sorted(n for n, _ in module.named_parameters()) == sorted(names)
    weight_shape = (12 // etp, 8) if parallel_mode == "column" else (12, 8 // etp)
    assert all(module.get_parameter(f"weight{i}").shape == weight_shape for i in range(3))
    use_expert_pgs = ep > 1 or etp != tp
    ours = {name: {a: getattr(p, a, None) for a in ATTRIBUTES} for name, p in module.named_parameters()}
    assert ours == _megatron_attributes(module, parallel_mode, use_expert_pgs)
    assert (module.tensor_model_parallel, module.partition_dim) == (True, 0 if parallel_mode == "column" else 1)


def test_grouped_linear_stand_in_refuses_a_forward_and_dense_use():
    config = _expert_config(ep=1, etp=1, tp=1)
    kwargs = dict(
        config=config,
        init_method=None,
        bias=False,
        skip_bias_add=False,
        pg_collection=SimpleNamespace(expt_tp=_Group(1)),
    )
    module = cpu_stand_ins.ColumnParallelGroupedLinear(2, 4, 4, is_expert=True, **kwargs)
    with pytest.raises(NotImplementedError, match="GPU build"):
        module(torch.zeros(1, 4), [1, 0])
    with pytest.raises(ValueError, match="expert"):
        cpu_stand_ins.ColumnParallelGroupedLinear(2, 4, 4, is_expert=False, **kwargs)
