"""The sharded colocated refit into a tensor-parallel engine without vLLM: recorded reads moved into
shards (engines.replay.shard_remap, ApplyPlan.record(shards=...), RefitReceiver on a layout of shards), and
the whole loop from a Megatron model through the sharded transfer into a vLLM-like TP2 engine
(tests/ranks/tp_engine.py) on 2 CPU ranks (tests/ranks/sharded_engine_check.py).

Blockwise FP8 through the same loop: an engine holding FP8 weights and their block scales, fed each
rank's shards quantized on that rank, bitwise equal to the whole HF tensors quantized by the reference
quantizer and cut by the engine's own loaders; a layout off the block grid refused by name first.

vLLM itself at tensor_parallel_size=2 is checked on the GPU host (scripts/check_vllm_refit_tp2_gpu.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, block_scaled_checkpoint, torchrun

from mbridge_refit.engines.ipc.sharing import LayoutRecorder, LocalTransport, ShardBox, SharedLayout
from mbridge_refit.engines.replay.apply_plan import ApplyPlan, ApplyPlanError
from mbridge_refit.engines.replay.shard_remap import ShardRemapError, box_view, expand, remap

CHECKER = str(REPO / "tests" / "ranks" / "sharded_engine_check.py")


class _RankOfTwo(torch.nn.Module):
    """Rank 1 of a 2-way engine: a column-parallel ``w`` (rows 4..8 of 8), a row-parallel ``o``
    (columns 2..4 of 4), a norm through a temporary; ``greedy`` reads one row too many."""

    def __init__(self, greedy: bool = False, norm_reads_neighbour: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(5, 2), requires_grad=False)
        self.n = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.greedy, self.norm_reads_neighbour = greedy, norm_reads_neighbour

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "w":
                self.w.data.copy_(tensor.narrow(0, 3 if self.greedy else 4, 4))
            elif name == "o":
                self.o.data.copy_(tensor.narrow(1, 2, 2))
            elif name == "n":
                rows = tensor.narrow(0, 1 if self.norm_reads_neighbour else 2, 2)
                self.n.data.copy_(rows * 1.0)  # a temporary: loaded by the loader every step


FULL = {"w": (8, 3), "o": (5, 4), "n": (4,)}
BOXES = {"w": ((4, 8), (0, 3)), "o": ((0, 5), (2, 4)), "n": ((2, 4),)}


def _shards() -> dict[str, torch.Tensor]:
    return {name: torch.randn(tuple(b - a for a, b in box)) for name, box in BOXES.items()}


def _recorded(model, shards):
    return ApplyPlan.record(model, list(shards.items()), shards={n: (t, FULL[n], BOXES[n]) for n, t in shards.items()})


def test_expand_puts_the_shard_in_its_box():
    shard = torch.randn(4, 3)
    full = expand(shard, (8, 3), ((4, 8), (0, 3)))
    assert torch.equal(box_view(full, ((4, 8), (0, 3))), shard) and not torch.equal(full[:4], full[4:])


def test_remap_reads_the_same_elements_from_the_shard():
    shard = torch.randn(5, 2)
    full = expand(shard, (5, 4), ((0, 5), (2, 4)))
    view = full.narrow(1, 2, 2).narrow(0, 1, 3)
    assert torch.equal(remap(view, full, shard, ((0, 5), (2, 4)), "o"), view)
    scalar = full[4, 3]
    assert torch.equal(remap(scalar, full, shard, ((0, 5), (2, 4)), "o"), scalar)
    with pytest.raises(ShardRemapError, match=r"o: the engine's loader reads \[\(0, 5\), \(1, 3\)\].*holds"):
        remap(full.narrow(1, 1, 2), full, shard, ((0, 5), (2, 4)), "o")
    transposed = full.narrow(1, 2, 2).t()
    assert torch.equal(remap(transposed, full, shard, ((0, 5), (2, 4)), "o"), transposed)
    with pytest.raises(ShardRemapError, match="not a box"):
        remap(full.reshape(-1).narrow(0, 1, 6), full, shard, ((0, 5), (2, 4)), "o")


def test_fp8_data_and_its_scale_box_remap_and_a_read_outside_is_refused():
    """Rank 1 of a TP2 split of a (512, 320) FP8 weight: its rows [256, 512) and their scales, blocks
    [2, 4) of the (4, 3) scale tensor, read from the shards; one block row above is refused by name."""
    from mbridge_refit.fp8.format import scale_box

    box = ((256, 512), (0, 320))
    data = (torch.randn(256, 320) * 100).to(torch.float8_e4m3fn)
    full = expand(data, (512, 320), box)
    assert torch.equal(remap(full.narrow(0, 256, 256), full, data, box, "w").view(torch.uint8), data.view(torch.uint8))
    assert scale_box(box) == ((2, 4), (0, 3))
    scales = torch.rand(2, 3)
    full_scales = expand(scales, (4, 3), scale_box(box))
    assert torch.equal(remap(full_scales.narrow(0, 2, 2), full_scales, scales, scale_box(box), "w_scale_inv"), scales)
    with pytest.raises(ShardRemapError, match=r"w_scale_inv: the engine's loader reads \[\(1, 3\), \(0, 3\)\]"):
        remap(full_scales.narrow(0, 1, 2), full_scales, scales, scale_box(box), "w_scale_inv")


def test_a_plan_recorded_full_size_replays_from_the_shards():
    model, shards = _RankOfTwo(), _shards()
    plan = _recorded(model, shards)
    assert plan.copies == 2 and plan.via_loader == ["n"]
    kept = {step.name: step.source for step in plan.steps}  # full-size only where the loader runs every step
    assert kept["w"] is shards["w"] and kept["o"] is shards["o"] and kept["n"].shape == FULL["n"]
    plan.check_against_loader()
    for shard in shards.values():
        shard.add_(1.0)
    plan.replay()
    assert torch.equal(model.w.data, shards["w"]) and torch.equal(model.o.data, shards["o"])
    assert torch.equal(model.n.data, shards["n"])


def test_a_read_outside_the_box_is_refused_by_name():
    with pytest.raises(ShardRemapError, match=r"w: the engine's loader reads \[\(3, 7\), \(0, 3\)\]"):
        _recorded(_RankOfTwo(greedy=True), _shards())


def test_a_loader_that_reads_outside_the_box_through_a_temporary_fails_the_check():
    plan = _recorded(_RankOfTwo(norm_reads_neighbour=True), _shards())
    with pytest.raises(ApplyPlanError, match="outside the shard's box"):
        plan.check_against_loader()


def test_a_layout_of_shards_round_trips_and_opens():
    from mbridge_refit.engines.ipc.engine import RefitReceiver

    shards = _shards()
    recorder = LayoutRecorder()
    for name, shard in shards.items():
        recorder.add(name, shard, shard=ShardBox(FULL[name], BOXES[name]))
    layout, storages = recorder.layout()
    assert SharedLayout.from_wire(layout.to_wire()) == layout
    model, transport = _RankOfTwo(), LocalTransport()
    report = RefitReceiver(model, torch.device("cpu")).open(layout.to_wire(), transport.share(storages), transport.name)
    assert report["shards"] == 3 and report["via_loader"] == ["n"] and not report["missing"]
    assert torch.equal(model.o.data, shards["o"])


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("recipe", "flags"),
    [
        ("qwen3-tiny", ["--tp", "2"]),
        ("qwen3-tiny", []),
        ("qwen3-moe-tiny", ["--tp", "2"]),
        ("qwen3-moe-tiny", ["--ep", "2"]),
    ],
    ids=["dense-tp2", "dense-tp1", "moe-tp2", "moe-ep2"],
)
def test_sharded_refit_into_a_tp2_engine(recipe, flags, source_checkpoints, tmp_path):
    """Trainer at TP2 (or TP1 / EP2, two replicas) into a vLLM-like engine at TP2, engine rank r on
    trainer rank r: exact against the engine's own load of the checkpoint and of the changed model;
    an engine whose loader reads outside its shard is refused by name on every rank."""
    run = torchrun(2, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["ok"] for r in reports) and all(r["copies"] > 0 and r["via_loader"] > 0 for r in reports)
    if flags == ["--tp", "2"]:
        assert reports[0]["bytes_moved"] == 0  # agreeing layouts: every shard from the rank itself


@pytest.mark.multirank
def test_sharded_refit_from_tp2_into_a_tp4_engine(source_checkpoints, tmp_path):
    """The plan for TP4 on 4 CPU ranks: a trainer at TP2 (two replicas) into an engine at TP4, whose
    2 kv heads are each replicated on two engine ranks (vLLM's ``tp_rank // num_kv_head_replicas``):
    exact, the halves a trainer rank does not hold moved from another rank."""
    recipe, flags = "qwen3-tiny", ["--tp", "2", "--engine-tp", "4"]
    run = torchrun(4, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in reports) and reports[0]["bytes_moved"] > 0


# Every TP2 box of a quantized weight is whole 128x128 blocks: head_dim 128 (q: 256 rows a rank, k/v:
# 128), FFN 512 and expert FFN 256 (256 a rank); hidden 320 ends every unsplit dimension in a partial block.
FP8_ALIGNED = {
    "hidden_size": 320,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "vocab_size": 512,
    "num_hidden_layers": 2,
}


@pytest.fixture(scope="module")
def fp8_aligned_checkpoints(tmp_path_factory):
    """Qwen3 and Qwen3-MoE checkpoints of ``FP8_ALIGNED`` shapes, every 128x128 block of a 2-D weight
    scaled by its own power of two, so that blocks' scales differ (a scale from another block is caught)."""
    root = tmp_path_factory.mktemp("fp8-tp2")
    dense = {k: v for k, v in FP8_ALIGNED.items() if k != "moe_intermediate_size"}
    return {
        name: block_scaled_checkpoint(base, extra, root / name, name=f"{base}-fp8-tp2", seed=11)
        for name, base, extra in (("dense", "qwen3-tiny", dense), ("moe", "qwen3-moe-tiny", FP8_ALIGNED))
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model", "flags"),
    [("dense", ["--tp", "2"]), ("dense", []), ("moe", ["--tp", "2"])],
    ids=["dense-tp2", "dense-tp1", "moe-tp2"],
)
def test_fp8_sharded_refit_into_a_tp2_engine(model, flags, fp8_aligned_checkpoints, tmp_path):
    """Blockwise FP8 into a TP2 engine holding FP8 weights and block scales (trainer at TP2, or TP1 with
    two replicas): each rank quantizes its own shards; the engine equals, bit for bit, the whole HF
    tensors (the checkpoint, then the changed model's stock export) quantized by the reference
    quantizer and cut to the rank by the engine's loaders, weight and scale; norms stay BF16 through
    the loader, routers BF16; an engine whose o_proj loader reads outside the shard is refused."""
    checkpoint = str(fp8_aligned_checkpoints[model])
    run = torchrun(2, [CHECKER, "--hf", checkpoint, "--result", str(tmp_path), "--fp8", *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["ok"] and r["quantized"] > 0 and r["copies"] > 0 for r in reports)


@pytest.mark.multirank
def test_fp8_sharded_refit_off_the_block_grid_is_refused_by_name(source_checkpoints, tmp_path):
    """qwen3-tiny at engine TP2 (FFN 128: gate/up split into 64-row halves, head_dim 16: q into 32 rows): the FP8
    refit is refused on every rank naming the tensor, the engine rank's box and the fix, before any shard
    is allocated or the engine is called."""
    checkpoint = str(source_checkpoints("qwen3-tiny"))
    run = torchrun(2, [CHECKER, "--hf", checkpoint, "--result", str(tmp_path), "--tp", "2", "--fp8-refused"])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["ok"] and "not whole 128-element blocks" in r["refusal"] for r in reports)


def test_a_worker_without_an_entry_is_refused_by_name():
    from mbridge_refit.engines.ipc.sharded import ShardedRefitError, worker_entry

    assert worker_entry(["a", "b"], 1, "layout") == "b"
    with pytest.raises(ShardedRefitError, match=r"no layout for engine rank 2: the trainer sent 2 engine ranks"):
        worker_entry(["a", "b"], 2, "layout")
    with pytest.raises(ShardedRefitError, match=r"no layout for engine rank 0.*\[1\] filled"):
        worker_entry([None, "b"], 0, "layout")
