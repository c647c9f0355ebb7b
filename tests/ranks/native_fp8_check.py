"""Per-rank check of the FP8 export from FP8 *parameters* (TE ``fp8_param`` models), on CPU.

Usage: native_fp8_check.py --hf CKPT [--tp N --pp N --ep N] [--expect-error TEXT]

A CPU build cannot run Transformer Engine's quantization kernels, so this stands in for TE's
``fp8_model_init``: every linear weight of this rank's shard is replaced by a real TE
``Float8BlockwiseQTensor`` holding that *local shard* quantized by ``te_style_quantize`` below
(128x128 blocks anchored at the shard's (0, 0), power-of-two scales as TE's default
``force_pow_2_scales``, the scale's column count padded to a multiple of 4 as TE's GEMM wants).
Then, failing with exit 1 on any difference:

  * the FP8 export's plan (name, shape, dtype) list equals what the export yields, in order;
  * every FP8 weight and ``weight_scale_inv`` equals ``te_style_quantize`` of the HF tensor on
    disk (the oracle): the per-shard blocks were split and gathered into the HF tensor's blocks;
  * a second (cached) export yields the same bytes;
  * the BF16 export of the same model equals the stock Megatron-Bridge export (which
    dequantizes each shard with TE) and the oracle's quantized checkpoint tensor dequantized.

With ``--expect-error``, the FP8 export must instead raise ``FP8FormatError`` containing TEXT
before any tensor is yielded.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import math
from pathlib import Path

import torch
import torch.distributed as dist
from rank_checks import fail, oracle, same_bytes

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags

BLOCK = 128
QUANTIZED_PARAMS = ("*.linear_qkv.weight", "*.linear_proj.weight", "*.linear_fc1.weight*", "*.linear_fc2.weight*")


def te_style_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, fp32 scale_inv [ceil(r/128), ceil(c/128)]) with power-of-two scales, by a
    plain loop over blocks: scale_inv = the smallest power of two with amax / scale_inv <= 448."""
    rows, cols = x.shape
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = x[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            amax = block.abs().max().item()
            scale_inv = 1.0 if amax == 0 else 2.0 ** math.ceil(math.log2(amax / 448.0))
            scales[i, j] = scale_inv
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (block / scale_inv).to(torch.float8_e4m3fn)
    return q, scales


def te_parameter(local: torch.Tensor) -> torch.nn.Parameter:
    """A TE Float8BlockwiseQTensor parameter holding ``local`` quantized as TE would."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
        Float8BlockwiseQTensor,
    )

    q, scales = te_style_quantize(local)
    padded_cols = -(-scales.shape[1] // 4) * 4
    padded = torch.full((scales.shape[0], padded_cols), float("nan"), dtype=torch.float32)  # padding must never be read
    padded[:, : scales.shape[1]] = scales
    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=2)
    tensor = Float8BlockwiseQTensor(
        shape=tuple(local.shape),
        dtype=local.dtype,
        rowwise_data=q.view(torch.uint8),
        rowwise_scale_inv=padded,
        columnwise_data=None,
        columnwise_scale_inv=None,
        fp8_dtype=tex.DType.kFloat8E4M3,
        quantizer=quantizer,
        is_2D_scaled=True,
        device=local.device,
    )
    return torch.nn.Parameter(tensor, requires_grad=False)


def quantize_parameters_like_te(chunks) -> int:
    replaced = 0
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            for attr, param in list(module.named_parameters(recurse=False)):
                if any(fnmatch.fnmatchcase(f"{name}.{attr}", p) for p in QUANTIZED_PARAMS):
                    setattr(module, attr, te_parameter(param.detach()))
                    replaced += 1
    return replaced


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    add_layout_flags(parser)
    parser.add_argument("--expect-error", default=None)
    args = parser.parse_args()

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.fp8.format import FP8FormatError
    from mbridge_refit.fp8.reference import dequantize_blockwise
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = layout_from_flags(args)
    cpu = torch.device("cpu")
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=5)):
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, args.hf)
        if not quantize_parameters_like_te(chunks):
            fail("no parameter was turned into a Float8BlockwiseQTensor")

        if args.expect_error is not None:
            try:
                next(iter(bridge.export_hf_weights(chunks, show_progress=False, fp8="blockwise")))
            except FP8FormatError as err:
                if args.expect_error not in str(err):
                    fail(f"FP8FormatError without {args.expect_error!r}: {err}")
                return
            fail("the FP8 export of shards off block boundaries did not raise FP8FormatError")

        read = oracle(args.hf)
        plan = bridge.export_plan(chunks, fp8="blockwise")
        native = [e for e in plan.entries if e.source_format == "fp8_blockwise" and e.scale_of is not None]
        if not native:
            fail("the FP8 plan has no scale shipped from FP8 parameters")
        expected = [(e.hf_name, tuple(e.shape), e.torch_dtype) for e in plan.entries]
        first = {}
        for attempt in range(2):
            got = []
            for name, tensor in bridge.export_hf_weights(
                chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"
            ):
                got.append((name, tuple(tensor.shape), tensor.dtype))
                if attempt == 0:
                    first[name] = tensor.clone()
                elif not same_bytes(tensor, first[name]):
                    fail(f"{name}: the second cached FP8 export differs from the first")
            if got != expected:
                fail(f"FP8 export order/shape/dtype differs from its plan: {got[:4]} vs {expected[:4]}")
        quantized_oracle = {}  # HF name -> (q, scales) of the checkpoint's tensor
        for entry in plan.entries:
            if entry.scale_of is not None:
                continue
            source = read(entry.hf_name)
            if entry.dtype != "float8_e4m3fn":
                if not same_bytes(first[entry.hf_name], source):
                    fail(f"{entry.hf_name} (kept in {entry.dtype}) differs from the checkpoint")
                continue
            q, scales = quantized_oracle[entry.hf_name] = te_style_quantize(source)
            if not same_bytes(first[entry.hf_name], q):
                fail(f"{entry.hf_name}: FP8 data differs from the HF tensor quantized blockwise")
            if not same_bytes(first[entry.hf_name + "_scale_inv"], scales):
                fail(f"{entry.hf_name}_scale_inv differs from the HF tensor's block scales")

        stock = {n: t.clone() for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        for name, tensor in bridge.export_hf_weights(chunks, show_progress=False):
            if not same_bytes(tensor, stock[name]):
                fail(f"{name}: BF16 export of the FP8 model differs from the stock export (which dequantizes)")
            if name in quantized_oracle:
                dequant = dequantize_blockwise(*quantized_oracle[name]).to(tensor.dtype)
                if not same_bytes(tensor, dequant):
                    fail(f"{name}: BF16 export differs from the FP8 export dequantized")
        print(f"[rank{dist.get_rank()}] native FP8 export ok: {len(native)} scales from FP8 parameters", flush=True)


if __name__ == "__main__":
    main()
