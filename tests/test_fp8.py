"""BF16 -> blockwise FP8 export: bit-exact against a reference quantizer written here.

The oracle is the source checkpoint on disk, quantized by ``reference_quantize`` (a plain loop
over 128x128 blocks in fp32), never the package's own quantizer output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref

import pytest
import torch
from conftest import REPO, block_scaled_checkpoint, run_interpreted, torchrun
from oracle import read_checkpoint
from safetensors.torch import load_file, save_file

from mbridge_refit.fp8.format import BlockwiseFP8Config, FP8FormatError
from mbridge_refit.fp8.plan import check_fp8_exportable, fp8_plan
from mbridge_refit.fp8.quantize import quantize_blockwise
from mbridge_refit.fp8.reference import dequantize_blockwise
from mbridge_refit.models import recipes
from mbridge_refit.plan.entries import ExportPlan

E4M3_MAX = 448.0


def reference_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale_inv = amax/448 (1.0 for an all-zero block), q = e4m3(clamp(x/scale_inv)),
    both divisions correctly rounded to float32."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128), dtype=torch.float32)
    for bi in range(scales.shape[0]):
        for bj in range(scales.shape[1]):
            block = weight[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128].to(torch.float64)
            # Divisions in float64, then rounded once to float32: for a quotient of two float32
            # values that equals the correctly rounded float32 division (IEEE), computed another way.
            scale = torch.tensor(block.abs().max().item() / E4M3_MAX, dtype=torch.float32)
            if scale.item() == 0.0:
                scale = torch.tensor(1.0, dtype=torch.float32)
            scales[bi, bj] = scale
            quotient = (block / scale.double()).to(torch.float32)
            q[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] = quotient.clamp(-E4M3_MAX, E4M3_MAX).to(
                torch.float8_e4m3fn
            )
    return q, scales


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def special_values(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random bf16 with an all-zero block (0, 0), a block of tiny values only (0, 1), and huge
    values among ordinary ones in block (1, 1), as far as the shape has those blocks."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    w = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    w[:128, :128] = 0
    if cols > 128:
        w[:128, 128:256] = (torch.randn(min(rows, 128), min(cols, 256) - 128, generator=gen) * 1e-30).to(torch.bfloat16)
    if rows > 131 and cols > 131:
        w[128, 128] = 3.3e38  # near the bf16 maximum
        w[129, 129] = -3.3e38
        w[130, 130] = 1e-38  # tiny next to huge: flushes to zero in e4m3
    return w


SHAPES = [(128, 128), (256, 384), (300, 200), (1, 7), (129, 257), (64, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("values", ["normal", "special"])
def test_quantizer_matches_reference_bitwise(shape, values):
    gen = torch.Generator().manual_seed(7)
    w = (
        (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if values == "normal"
        else special_values(shape, 3)
    )
    q, s = quantize_blockwise(w)
    ref_q, ref_s = reference_quantize(w)
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)) and s.dtype == torch.float32
    assert same_bits(s, ref_s)
    assert same_bits(q, ref_q)


@pytest.mark.parametrize("values", ["normal", "special"])
def test_dequantized_within_e4m3_rounding(values):
    w = special_values((300, 260), 11) if values == "special" else (torch.randn(300, 260) * 0.02).to(torch.bfloat16)
    q, s = quantize_blockwise(w)
    deq, x = dequantize_blockwise(q, s).double(), w.double()
    scale = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4 for normal values; below 2^-6 the spacing is
    # 2^-9 (subnormal), i.e. absolute error <= 2^-10 * scale. Allow fp32 rounding of x / scale.
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert torch.isfinite(deq).all()
    assert ((deq - x).abs() <= bound).all()
    assert (q.float().abs() <= E4M3_MAX).all()


def test_quantizer_reuses_given_buffers():
    w = (torch.randn(200, 300) * 0.02).to(torch.bfloat16)
    out = torch.empty(200, 300, dtype=torch.float8_e4m3fn)
    scale = torch.empty(2, 3, dtype=torch.float32)
    work = torch.empty(256, 384, dtype=torch.float32)
    q, s = quantize_blockwise(w, out=out, scale_out=scale, work=work)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == scale.data_ptr()
    assert same_bits(q, reference_quantize(w)[0])


def test_shard_quantizer_writes_the_reference_bits_into_kept_buffers():
    """An engine rank's shards, quantized every step into the buffers made once (the sharded FP8 refit)."""
    from mbridge_refit.fp8.quantize import ShardQuantizer

    sources = {"a": special_values((300, 200), seed=1), "b": special_values((128, 64), seed=2)}
    quantizer = ShardQuantizer(sources)
    kept = [t.data_ptr() for t in (*quantizer.q.values(), *quantizer.scales.values())]
    for _ in range(2):
        quantizer.run()
        for name, source in sources.items():
            expected_q, expected_scale = reference_quantize(source)
            assert same_bits(quantizer.q[name], expected_q) and same_bits(quantizer.scales[name], expected_scale), name
        for source in sources.values():
            source.mul_(3)  # the next step's weights, in the same storage
    assert [t.data_ptr() for t in (*quantizer.q.values(), *quantizer.scales.values())] == kept


def test_quantizer_rejects_non_2d():
    with pytest.raises(FP8FormatError, match="2-D"):
        quantize_blockwise(torch.zeros(4, 4, 4, dtype=torch.bfloat16))


def test_bucket_quantizer_follows_new_data_and_reuses_buffers():
    """A persistent pool's bucket quantizer is decided once; later exports with new values still
    give the reference bits, into the same buffers, with nothing allocated."""
    from mbridge_refit.fp8.format import SCALE_SUFFIX
    from mbridge_refit.fp8.quantize import quantize_buckets
    from mbridge_refit.runtime.buffers import ExportBuffers

    weight, norm = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
    shapes = {weight: (300, 200), norm: (200,)}
    gen = torch.Generator().manual_seed(3)
    buffers = ExportBuffers(persistent=True)
    plan = _FakePlan({weight: (3, 2)})
    outputs = []
    for _ in range(3):
        bucket = [(n, (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)) for n, shape in shapes.items()]
        before = buffers.allocations
        got = dict(quantize_buckets([bucket], plan, buffers))
        q, s = reference_quantize(bucket[0][1])
        assert same_bits(got[weight], q) and same_bits(got[weight + SCALE_SUFFIX], s)
        assert got[norm] is bucket[1][1]
        outputs.append((got[weight].data_ptr(), buffers.allocations - before))
        source = weakref.ref(bucket[0][1])
        del bucket, got
        assert source() is None, "the buffer pool keeps a reference to an export's source tensor"
    assert outputs[1] == (outputs[0][0], 0) and outputs[2] == (outputs[0][0], 0)
    assert len(buffers.memo) == 1


def test_row_selections_are_quantized_from_their_source():
    """q, k and v selected lazily from a fused QKV (``export_buckets(select_rows_lazily=True)``
    at TP1): runs of whole block rows are quantized straight from the fused tensor (the selection
    is never copied out), runs off block rows are copied out first; both give the reference
    bits of the HF tensor, export after export."""
    from mbridge_refit.fp8.format import SCALE_SUFFIX
    from mbridge_refit.fp8.quantize import quantize_buckets
    from mbridge_refit.runtime.buffers import ExportBuffers
    from mbridge_refit.runtime.selection import RowSelection

    group_rows = {"q": 256, "k": 128, "v": 72}  # per KV group, in this order; v's runs are off block rows
    offsets = {"q": 0, "k": 256, "v": 384}
    groups, cols = 2, 200
    names = {key: f"model.layers.0.self_attn.{key}_proj.weight" for key in group_rows}
    plan = _FakePlan({names[key]: (math.ceil(groups * n / 128), 2) for key, n in group_rows.items()})
    buffers, gen = ExportBuffers(persistent=True), torch.Generator().manual_seed(4)
    for _ in range(2):
        fused = special_values((groups * 456, cols), seed=int(torch.randint(0, 100, (1,), generator=gen)))
        copies = []

        def selection(key):
            n = group_rows[key]
            runs = tuple((g * n, g * 456 + offsets[key], n) for g in range(groups))
            rows = torch.cat([fused[src : src + n] for _, src, n in runs])
            return RowSelection(fused, runs, tuple(rows.shape), lambda: copies.append(key) or rows)

        bucket = [(names[key], selection(key)) for key in group_rows]
        got = dict(quantize_buckets([bucket], plan, buffers))
        for key, n in group_rows.items():
            expected = torch.cat([fused[g * 456 + offsets[key] :][:n] for g in range(groups)])
            q, scale = reference_quantize(expected)
            assert same_bits(got[names[key]], q) and same_bits(got[names[key] + SCALE_SUFFIX], scale), key
        assert copies == ["v"]


@dataclasses.dataclass
class _FakePlan:
    """What ``quantize_buckets`` reads of an FP8 plan: entries with ``scale_of``, ``hf_name``,
    ``shape`` (weight name -> its scale's shape)."""

    scales: dict

    @property
    def entries(self):
        from mbridge_refit.fp8.format import SCALE_SUFFIX

        entry = dataclasses.make_dataclass("Entry", ["scale_of", "hf_name", "shape"])
        return [entry(weight, weight + SCALE_SUFFIX, shape) for weight, shape in self.scales.items()]


def test_grouped_kernel_writes_what_the_single_kernel_writes():
    """The grouped Triton kernel (one launch per export bucket) against the single-tensor kernel,
    both run by Triton's CPU interpreter (the GPU bits of both are checked against the torch path
    on every CUDA device before use, and by scripts/bench_export.py --fp8)."""
    run_interpreted("grouped_fp8_kernel_check.py", "grouped == single kernel")


# --- plan and config ---------------------------------------------------------------------------


def _plan_with(names_shapes) -> ExportPlan:
    from mbridge_refit.plan.entries import PlanEntry, TensorSharding
    from mbridge_refit.plan.slices import SliceCopy

    def entry(name, shape, kind="column"):
        sharding = TensorSharding(
            mesh_dims=("tp", "dp"),
            mesh_shape=(1, 1),
            placements=("Replicate()", "Replicate()"),
            pieces=((SliceCopy(hf_name=name, dim=0, hf_start=0, hf_stop=shape[0], local_start=0),),),
            local_shape=shape,
        )
        return PlanEntry(
            hf_name=name,
            shape=shape,
            dtype="bfloat16",
            megatron_param=name,
            pp_rank=0,
            vpp_stage=0,
            is_expert=False,
            kind=kind,
            sharding=sharding,
        )

    entries = tuple(entry(*item) for item in names_shapes)
    return ExportPlan(entries=entries, layer_map={0: (0, 0)}, tp=1, pp=1, ep=1, vpp=1)


# What Qwen3 / Qwen3-MoE FP8 checkpoints keep, written here (the per-family table is tested in test_fp8_keep.py).
KEEP = BlockwiseFP8Config(keep_patterns=("*embed_tokens.weight", "lm_head.weight", "*norm.weight", "*.mlp.gate.weight"))
PLAN_ITEMS = [
    ("model.embed_tokens.weight", (512, 192)),
    ("model.layers.0.input_layernorm.weight", (192,)),
    ("model.layers.0.self_attn.q_proj.weight", (256, 192), "qkv"),
    ("model.layers.0.self_attn.q_norm.weight", (64,)),
    ("model.layers.0.self_attn.o_proj.weight", (192, 256), "row"),
    ("model.layers.0.mlp.gate.weight", (4, 192)),
    ("lm_head.weight", (512, 192)),
]


def test_fp8_plan_names_shapes_dtypes():
    plan = fp8_plan(_plan_with(PLAN_ITEMS), KEEP)
    got = [(e.hf_name, e.shape, e.dtype) for e in plan.entries]
    assert got == [
        ("model.embed_tokens.weight", (512, 192), "bfloat16"),
        ("model.layers.0.input_layernorm.weight", (192,), "bfloat16"),
        ("model.layers.0.self_attn.q_proj.weight", (256, 192), "float8_e4m3fn"),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", (2, 2), "float32"),
        ("model.layers.0.self_attn.q_norm.weight", (64,), "bfloat16"),
        ("model.layers.0.self_attn.o_proj.weight", (192, 256), "float8_e4m3fn"),
        ("model.layers.0.self_attn.o_proj.weight_scale_inv", (2, 2), "float32"),
        ("model.layers.0.mlp.gate.weight", (4, 192), "bfloat16"),
        ("lm_head.weight", (512, 192), "bfloat16"),
    ]
    assert [e.scale_of for e in plan.entries if e.scale_of] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    ]
    assert plan.entries[3].nbytes == 2 * 2 * 4
    assert ExportPlan.from_json(plan.to_json()) == plan


def test_quantization_config_lists_unconverted_modules():
    config = KEEP.quantization_config(_plan_with(PLAN_ITEMS))
    assert config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"],
    }


def test_engine_tp_that_cannot_block_is_refused_with_the_fix():
    plan = _plan_with(PLAN_ITEMS)
    check_fp8_exportable(plan, dataclasses.replace(KEEP, engine_tp_size=2))  # 256/2 = 128 rows, 256/2 = 128 cols
    with pytest.raises(FP8FormatError, match=r"q_proj.weight output size 256 / tp 4 is not a multiple of 128.*smaller"):
        check_fp8_exportable(plan, dataclasses.replace(KEEP, engine_tp_size=4))


def _transfer_with(boxes):
    """A TP2 transfer plan of these engine boxes (``(hf_name, engine rank, box)``), no moves."""
    from mbridge_refit.plan.engine_layout import EngineLayout
    from mbridge_refit.plan.transfer import EngineShard, TransferPlan

    shards = tuple(
        EngineShard(hf_name=name, engine_rank=rank, target_rank=rank, box=box, dtype="bfloat16")
        for name, rank, box in boxes
    )
    return TransferPlan(engine=EngineLayout(tp=2), engine_ranks=(0, 1), shards=shards, moves=(), full_gather_bytes=0)


def test_engine_boxes_off_the_block_grid_are_refused_with_the_fix():
    """A sharded FP8 refit quantizes each engine rank's box alone: each must start on a 128-block and end
    on one or at the tensor's end, in both dimensions; kept tensors may be cut anywhere."""
    from mbridge_refit.fp8.plan import check_engine_boxes

    plan = fp8_plan(_plan_with(PLAN_ITEMS), KEEP)
    q, o, embed = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.embed_tokens.weight",
    )
    aligned = [(q, 0, ((0, 128), (0, 192))), (q, 1, ((128, 256), (0, 192))), (o, 1, ((0, 192), (128, 256)))]
    check_engine_boxes(plan, _transfer_with([*aligned, (embed, 1, ((200, 512), (0, 192)))]))
    for name, box, dim in [(q, ((64, 256), (0, 192)), 0), (q, ((0, 100), (0, 192)), 0), (o, ((0, 192), (64, 256)), 1)]:
        pattern = (
            rf"tp2 cannot shard.*{name} \(\d+, \d+\): engine rank 1 keeps .*dimension {dim} .*not whole 128-element"
        )
        with pytest.raises(
            FP8FormatError, match=pattern + r".*smaller tensor-parallel size.*full tensors.*keep these weights in bf16"
        ):
            check_engine_boxes(plan, _transfer_with([(name, 1, box)]))


def test_nothing_to_quantize_is_refused():
    with pytest.raises(FP8FormatError, match="keep_patterns"):
        check_fp8_exportable(_plan_with(PLAN_ITEMS), BlockwiseFP8Config(keep_patterns=("*",)))


# --- through the export, every layout ---------------------------------------------------------

DENSE_CONFIG = {
    "hidden_size": 192,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 320,
    "vocab_size": 512,
}
MOE_CONFIG = {**DENSE_CONFIG, "moe_intermediate_size": 160}


@pytest.fixture(scope="module")
def block_checkpoints(tmp_path_factory):
    """Qwen3 / Qwen3-MoE checkpoints whose weights span several 128x128 blocks, partial ones
    included, with an all-zero block and extreme values planted in a few weights."""
    root = tmp_path_factory.mktemp("fp8-sources")
    made = {}
    for name, base, extra in [("dense", "qwen3-tiny", DENSE_CONFIG), ("moe", "qwen3-moe-tiny", MOE_CONFIG)]:
        recipe = recipes.get_model_recipe(base)
        recipe = dataclasses.replace(recipe, name=f"{base}-blocks", hf_config={**recipe.hf_config, **extra})
        path = recipes.make_random_checkpoint(recipe, root / name, seed=5)
        _plant_special_values(path)
        made[name] = path
    return made


def _plant_special_values(path):
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        tensors = load_file(str(file))
        for key in list(tensors):
            if key.endswith(
                ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "experts.1.up_proj.weight")
            ):
                tensors[key] = special_values(tuple(tensors[key].shape), seed=len(key))
        save_file(tensors, str(file), metadata={"format": "pt"})


LAYOUT_CASES = [
    ("dense", 1, []),
    ("dense", 2, ["--tp", "2"]),
    ("dense", 2, ["--pp", "2"]),
    ("dense", 2, ["--pp", "2", "--vpp", "2"]),
    ("dense", 4, ["--tp", "2", "--pp", "2"]),
    ("moe", 2, ["--ep", "2"]),
    ("moe", 2, ["--tp", "2", "--ep", "2"]),
]


def assert_fp8_checkpoint_is_reference(source, out) -> set[str]:
    """The FP8 checkpoint at ``out`` holds, for every linear weight of ``source``, the reference
    quantizer's e4m3 data and scales, and every other tensor as it is; returns the quantized names."""
    expected, written = read_checkpoint(source), read_checkpoint(out)
    config = KEEP  # what Qwen3 / Qwen3-MoE FP8 checkpoints keep, written independently of fp8.keep
    quantized = {n for n, t in expected.items() if config.quantizes(n, tuple(t.shape), "bfloat16")}
    assert sorted(written) == sorted(set(expected) | {f"{n}_scale_inv" for n in quantized})
    for name, source_tensor in expected.items():
        if name not in quantized:
            assert same_bits(written[name], source_tensor), name
            continue
        ref_q, ref_s = reference_quantize(source_tensor)
        assert same_bits(written[name], ref_q), name
        assert same_bits(written[f"{name}_scale_inv"], ref_s), name
    return quantized


@pytest.mark.parametrize(
    ("model", "nproc", "flags"),
    LAYOUT_CASES,
    ids=["tp1", "tp2", "pp2", "pp2_vpp2", "tp2_pp2", "moe-ep2", "moe-tp2_ep2"],
)
def test_roundtrip_fp8_matches_reference_quantizer(block_checkpoints, tmp_path, model, nproc, flags):
    source = block_checkpoints[model]
    out = tmp_path / "fp8"
    run = torchrun(
        nproc,
        [
            "mbridge_refit.convert",
            "roundtrip",
            "--hf",
            str(source),
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
            "--fp8-blockwise",
            *flags,
        ],
    )
    assert run.returncode == 0, run.output[-4000:]
    quantized = assert_fp8_checkpoint_is_reference(source, out)
    assert quantized and any("experts" in n for n in quantized) == (model == "moe")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128] and quant["fmt"] == "e4m3"
    assert "lm_head" in quant["modules_to_not_convert"]
    assert ("model.layers.0.mlp.gate" in quant["modules_to_not_convert"]) == (model == "moe")


def test_fp8_engine_tp_refused_before_export(block_checkpoints, tmp_path):
    out = tmp_path / "fp8"
    run = torchrun(
        1,
        [
            "mbridge_refit.convert",
            "roundtrip",
            "--hf",
            str(block_checkpoints["dense"]),
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
            "--fp8-blockwise",
            "--fp8-engine-tp",
            "2",
        ],
    )
    assert run.returncode == 2, run.output[-3000:]
    assert "tensor-parallel size 2 cannot shard" in run.output and "not a multiple of 128" in run.output
    assert not out.exists() or not any(out.glob("*.safetensors"))


def test_plan_cli_lists_scales(block_checkpoints, tmp_path):
    out = tmp_path / "plan.json"
    run = torchrun(
        1,
        [
            "mbridge_refit.convert",
            "plan",
            "--hf",
            str(block_checkpoints["dense"]),
            "--fp8-blockwise",
            "--json",
            str(out),
        ],
    )
    assert run.returncode == 0, run.output[-3000:]
    entries = json.loads(out.read_text())["entries"]
    by_name = {e["hf_name"]: e for e in entries}
    scale = by_name["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert scale["shape"] == [2, 2] and scale["dtype"] == "float32"  # q_proj is [256, 192]
    assert scale["scale_of"] == "model.layers.0.self_attn.q_proj.weight"
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert by_name["model.embed_tokens.weight"]["dtype"] == "bfloat16"
    assert "weight_scale_inv" in run.output


def test_megatron_checkpoint_export_to_fp8(block_checkpoints, tmp_path):
    """HF -> Megatron checkpoint (TP2) -> FP8 HF checkpoint at PP2."""
    source = block_checkpoints["dense"]
    megatron, out = tmp_path / "megatron", tmp_path / "fp8"
    run = torchrun(
        2, ["mbridge_refit.convert", "import", "--hf", str(source), "--megatron", str(megatron), "--tp", "2"]
    )
    assert run.returncode == 0, run.output[-4000:]
    run = torchrun(
        2,
        [
            "mbridge_refit.convert",
            "export",
            "--megatron",
            str(megatron),
            "--out",
            str(out),
            "--pp",
            "2",
            "--no-progress",
            "--fp8-blockwise",
        ],
    )
    assert run.returncode == 0, run.output[-4000:]
    expected, written = read_checkpoint(source), read_checkpoint(out)
    config = KEEP  # what Qwen3 FP8 checkpoints keep, written independently of fp8.keep
    for name, source_tensor in expected.items():
        if not config.quantizes(name, tuple(source_tensor.shape), "bfloat16"):
            assert same_bits(written[name], source_tensor), name
            continue
        ref_q, ref_s = reference_quantize(source_tensor)
        assert same_bits(written[name], ref_q) and same_bits(written[f"{name}_scale_inv"], ref_s), name
    assert len(written) > len(expected)
    assert "quantization_config" in json.loads((out / "config.json").read_text())


def test_fp8_stream_through_packed_broadcast(block_checkpoints, tmp_path):
    """Trainer rank 0 -> receiver rank 1: the FP8 plan sizes the receiver; bytes equal the reference."""
    from conftest import REPO

    run = torchrun(
        2,
        [
            str(REPO / "tests" / "ranks" / "fp8_broadcast_check.py"),
            "--hf",
            str(block_checkpoints["dense"]),
            "--result",
            str(tmp_path),
        ],
    )
    assert run.returncode == 0, run.output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["differing"] == []
    assert (
        result["scales"] > 0
        and len(result["names"]) == result["plan_entries"] == len(result["expected_names"]) + result["scales"]
    )


# --- FP8 parameters (TE fp8_param models): the trainer's own FP8 data and scales --------------

ALIGNED_CONFIG = {
    "hidden_size": 320,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 512,
}
NATIVE_CHECKER = str(REPO / "tests" / "ranks" / "native_fp8_check.py")


@pytest.fixture(scope="module")
def aligned_checkpoints(tmp_path_factory):
    """Checkpoints whose tensor-parallel shards are whole 128x128 blocks (head_dim 128, FFN 512,
    expert FFN 128), hidden 320 for partial edge blocks, and every 128x128 block of a weight
    scaled by its own power of two so that block scales differ (a misplaced scale is caught)."""
    root = tmp_path_factory.mktemp("fp8-aligned")
    return {
        name: block_scaled_checkpoint(base, extra, root / name, name=f"{base}-aligned", seed=3)
        for name, base, extra in [
            ("dense", "qwen3-tiny", ALIGNED_CONFIG),
            ("moe", "qwen3-moe-tiny", {**ALIGNED_CONFIG, "moe_intermediate_size": 128}),
        ]
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model", "nproc", "flags"),
    [
        ("dense", 2, ["--tp", "2"]),
        ("dense", 2, ["--pp", "2"]),
        ("dense", 4, ["--tp", "2", "--pp", "2"]),
        ("moe", 2, ["--ep", "2"]),
        ("moe", 2, ["--tp", "2", "--ep", "2"]),
    ],
    ids=["tp2", "pp2", "tp2_pp2", "moe-ep2", "moe-tp2_ep2"],
)
def test_fp8_parameters_export_their_own_data_and_scales(aligned_checkpoints, model, nproc, flags):
    """TE Float8BlockwiseQTensor parameters: FP8 bytes and scales shipped as stored, split and
    gathered into the HF tensor's blocks (oracle: the checkpoint on disk quantized blockwise);
    the BF16 export of the same model equals stock's dequantizing export."""
    run = torchrun(nproc, [NATIVE_CHECKER, "--hf", str(aligned_checkpoints[model]), *flags])
    assert run.returncode == 0, run.output[-6000:]
    assert run.output.count("native FP8 export ok") == nproc


@pytest.mark.multirank
def test_fp8_parameters_off_block_boundaries_are_refused(block_checkpoints):
    """head_dim 64 at TP2: q/k/v shards are half blocks; the export must refuse, naming the tensor."""
    run = torchrun(
        2,
        [
            NATIVE_CHECKER,
            "--hf",
            str(block_checkpoints["dense"]),
            "--tp",
            "2",
            "--expect-error",
            "not a run of whole 128-element blocks",
        ],
    )
    assert run.returncode == 0, run.output[-6000:]


@pytest.mark.parametrize("hold_outputs", [False, True], ids=["per-bucket", "held"])
def test_a_cached_fp8_export_follows_another_config_and_other_buckets(source_checkpoints, hold_outputs):
    """One bridge, its export cache on, exported in FP8 with another keep list, then with the family's, then
    with other bucket sizes, and back: each export equals Megatron-Bridge's stock export through the reference
    quantizer for that config (``testing.export_comparison.fp8_expected``), read after the whole export when
    the outputs are held. How a bucket is quantized is cached with the buffers; a cache keyed by the bucket's
    names alone served one config's quantizer to the other (scales missing or extra) and a quantizer built
    for one bucket number to another (its held outputs written into another bucket's buffers)."""
    import datetime

    from conftest import loaded_model

    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.fp8.format import BlockwiseFP8Config
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.runtime.exporter import DEFAULT_BUCKET_BYTES
    from mbridge_refit.testing.conformance import restored_environment
    from mbridge_refit.testing.export_comparison import fp8_expected

    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge, chunks = loaded_model(source_checkpoints("qwen3-moe-tiny"), layout, cpu)
        stock = [(n, t.detach().clone()) for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)]
        family = bridge.fp8_config("blockwise")
        experts_kept = BlockwiseFP8Config(keep_patterns=(*family.keep_patterns, "*.mlp.experts.*"))
        steps = [
            (experts_kept, DEFAULT_BUCKET_BYTES),
            ("blockwise", DEFAULT_BUCKET_BYTES),
            (experts_kept, DEFAULT_BUCKET_BYTES),
            ("blockwise", 1 << 16),
            ("blockwise", DEFAULT_BUCKET_BYTES),
        ]
        for config, bucket_bytes in steps:
            bridge.bucket_bytes = bucket_bytes
            stream = bridge.export_hf_weights(
                chunks, reuse_buffer_from_cache=True, hold_outputs=hold_outputs, fp8=config, show_progress=False
            )
            got = list(stream) if hold_outputs else [(n, t.clone()) for n, t in stream]
            expected = fp8_expected(stock, bridge.fp8_config(config))
            assert [n for n, _ in got] == [n for n, _ in expected], (config, bucket_bytes)
            wrong = [n for (n, a), (_, b) in zip(got, expected) if not same_bits(a, b)]
            assert wrong == [], (config, bucket_bytes, wrong[:5])
        bridge.release_export_buffers()
