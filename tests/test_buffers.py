"""``runtime.buffers.ExportBuffers``: a consumer's rebinding of a pooled buffer, found by
``check_pool`` (before an export's first collective) and by ``get`` (mid-export), naming the
tensor the buffer was last yielded as."""

from __future__ import annotations

import re

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


def test_one_rank_alone_is_refused_as_its_export_asks_for_the_rebound_buffer(source_checkpoints):
    """World size 1 enters no collective, so its pool is not checked before the export (that would cost
    a pass per export): the export refuses the rebound buffer by name where it asks for it, before it
    writes into it; after release_export_buffers() the export equals the checkpoint on disk."""
    import datetime

    from oracle import read_checkpoint

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    hf_dir = source_checkpoints("qwen3-tiny")
    on_disk = read_checkpoint(hf_dir)
    layout = ParallelLayout()
    with restored_environment(), distributed_session(layout, device=CPU, timeout=datetime.timedelta(minutes=2)):
        bridge = RefitBridge.from_hf_pretrained(hf_dir)
        chunks = build_model(bridge, layout, BuildOptions(device=CPU, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, hf_dir)
        first = dict(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
        second = dict(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
        pooled = [name for name, t in second.items() if t is first[name] and t._base is None]
        assert pooled, "no tensor of this export comes from a bridge-owned buffer"
        name = pooled[0]
        second[name].data = second[name].data.half()
        with pytest.raises(ReboundOutputError, match=re.escape(name)):
            for _ in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                pass
        bridge.release_export_buffers()
        again = dict(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
        assert again.keys() == on_disk.keys()
        assert all(torch.equal(again[k].view(torch.uint8), on_disk[k].view(torch.uint8)) for k in on_disk)
