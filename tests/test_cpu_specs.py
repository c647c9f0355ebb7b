"""CPU stand-ins for Transformer Engine modules (``mbridge_refit/tools/cpu_specs.py``) and CPU
materialisation (``tools/model_builder.py``): the stand-ins hold the parameters the GPU build
holds, with the attributes Megatron sets on them, and materialising keeps those attributes.

The oracle for the grouped linears' attributes is Megatron's own ``_set_expert_parameter_attributes``
(what ``TEGroupedLinear`` runs on its parameters); the conformance matrix (``test_conformance.py``)
checks whole models built with them against stock's export.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from mbridge_refit.tools import cpu_specs, model_builder

ATTRIBUTES = ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride")


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _config(*, ep: int, etp: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, tensor_model_parallel_size=tp,
        params_dtype=torch.bfloat16, perform_initialization=False,
    )


def _megatron_attributes(module: torch.nn.Module, parallel_mode: str, use_expert_pgs: bool) -> dict:
    """The attributes Megatron's ``TEGroupedLinear`` sets on parameters like ``module``'s."""
    from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes

    reference = torch.nn.Module()
    for name, param in module.named_parameters(recurse=False):
        reference.register_parameter(name, torch.nn.Parameter(torch.empty_like(param)))
    _set_expert_parameter_attributes(reference, parallel_mode, use_expert_pgs)
    return {name: {a: getattr(p, a, None) for a in ATTRIBUTES} for name, p in reference.named_parameters()}


@pytest.mark.parametrize(("stand_in", "parallel_mode"), [
    (cpu_specs.ColumnParallelGroupedLinear, "column"), (cpu_specs.RowParallelGroupedLinear, "row"),
])
@pytest.mark.parametrize(("ep", "etp", "tp"), [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 1, 2)])
def test_grouped_linear_stand_ins_carry_megatrons_expert_attributes(stand_in, parallel_mode, ep, etp, tp, monkeypatch):
    """``weight0..N-1`` (and biases) with TE's per-rank shapes and Megatron's expert attributes."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # get_pg_size reads the group
    config = _config(ep=ep, etp=etp, tp=tp)
    module = stand_in(
        3, 8, 12, config=config, init_method=None, bias=True, skip_bias_add=False, is_expert=True,
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
    config = _config(ep=1, etp=1, tp=1)
    kwargs = dict(config=config, init_method=None, bias=False, skip_bias_add=False, pg_collection=SimpleNamespace(expt_tp=_Group(1)))
    module = cpu_specs.ColumnParallelGroupedLinear(2, 4, 4, is_expert=True, **kwargs)
    with pytest.raises(NotImplementedError, match="GPU build"):
        module(torch.zeros(1, 4), [1, 0])
    with pytest.raises(ValueError, match="expert"):
        cpu_specs.ColumnParallelGroupedLinear(2, 4, 4, is_expert=False, **kwargs)


def test_stand_in_backend_answers_multi_latent_attention_while_it_is_open():
    """MLA's norm resolver gets the CPU fused norm + linear inside the block, TE's after it."""
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.transformer import mla_qk_norm_config

    get_backend = mla_qk_norm_config.get_backend
    with cpu_specs.stand_in_backend():
        backend = mla_qk_norm_config.get_backend("transformer_engine")
        assert backend.column_parallel_layer_norm_linear() is cpu_specs.LayerNormColumnParallelLinear
    assert mla_qk_norm_config.get_backend is get_backend
    assert get_backend("transformer_engine").column_parallel_layer_norm_linear() is TELayerNormColumnParallelLinear


def test_materialize_on_cpu_keeps_what_megatron_set_on_parameters():
    with torch.device("meta"):
        chunk = torch.nn.Sequential(torch.nn.Linear(4, 6))
    chunk[0].weight.tensor_model_parallel, chunk[0].weight.partition_dim = True, 0
    chunk[0].weight.allreduce = False
    plain = torch.nn.Sequential(torch.nn.Linear(4, 6, device="meta"))
    plain[0].weight.allreduce = False
    assert not hasattr(plain.to_empty(device="cpu")[0].weight, "allreduce")  # what to_empty alone does
    weight = model_builder.materialize_on_cpu(chunk)[0].weight
    assert weight.device.type == "cpu"
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.allreduce) == (True, 0, False)
