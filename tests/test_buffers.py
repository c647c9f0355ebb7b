"""``runtime.buffers.ExportBuffers``: a consumer's rebinding of a pooled buffer, found by
``check_pool`` (before an export's first collective) and by ``get`` (mid-export), naming the
tensor the buffer was last yielded as."""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.runtime.buffers import ExportBuffers, ReboundOutputError

CPU = torch.device("cpu")

REBINDS = {
    "half": lambda t: setattr(t, "data", t.data.half()),
    "transpose": lambda t: setattr(t, "data", t.data.t()),  # same address, other strides
    "set_": lambda t: t.set_(torch.empty_like(t)),
    "resize_": lambda t: t.resize_(1),
}


def _pool() -> tuple[ExportBuffers, torch.Tensor]:
    buffers = ExportBuffers(persistent=True)
    buffers.get("pack", 0, (3,), torch.float32, CPU)  # scratch: never yielded, never named
    out = buffers.get("out", (0, 0), (4, 4), torch.bfloat16, CPU, "model.layers.0.mlp.up_proj.weight")
    buffers.get("out", (0, 1), (2, 4), torch.bfloat16, CPU, "model.norm.weight")
    return buffers, out


@pytest.mark.parametrize("rebind", REBINDS)
def test_check_pool_names_the_rebound_buffer_as_it_was_last_yielded(rebind):
    buffers, out = _pool()
    buffers.check_pool()
    assert buffers.get("out", (0, 0), (4, 4), torch.bfloat16, CPU, "model.layers.1.mlp.up_proj.weight") is out
    REBINDS[rebind](out)
    with pytest.raises(ReboundOutputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight, a tensor the bridge"):
        buffers.check_pool()
    with pytest.raises(ReboundOutputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):  # mid-export: the same
        buffers.get("out", (0, 0), (4, 4), torch.bfloat16, CPU, "model.layers.2.mlp.up_proj.weight")
    buffers.release()
    buffers.check_pool()
    assert buffers.get("out", (0, 0), (4, 4), torch.bfloat16, CPU) is not out


def test_check_pool_passes_what_a_consumer_may_do_and_meta_buffers():
    buffers, out = _pool()
    out.copy_(torch.ones(4, 4))  # writing into a yielded tensor changes no storage
    out.clone().data = torch.zeros(1)  # rebinding a copy
    view = out[0]
    view.data = torch.zeros(4, dtype=torch.bfloat16)  # a view's rebinding leaves the buffer as it is
    buffers.get("recv", 0, (2,), torch.float32, torch.device("meta"), "model.embed_tokens.weight")
    buffers.check_pool()
    buffers.get("pack", 0, (3,), torch.float32, CPU).data = torch.zeros(1)  # scratch: the bridge's own business
    buffers.check_pool()
    ExportBuffers(persistent=False).check_pool()
