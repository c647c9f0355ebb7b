"""The blockwise FP8 weight format (DeepSeek-V3 style): its facts, its config, its names.

An HF FP8 checkpoint stores each quantized linear weight ``W`` [rows, cols] as

* ``<module>.weight``: ``float8_e4m3fn``, same shape as ``W``;
* ``<module>.weight_scale_inv``: ``float32`` [ceil(rows/128), ceil(cols/128)], one scale per
  128x128 block, such that ``W ~= weight.float() * weight_scale_inv`` (block-broadcast).

Choices, all in this module:

* **Block grid.** Blocks are anchored at (0, 0) of the *HF* tensor. A shape not divisible by
  128 has partial edge blocks; their scale covers only the elements that exist (no padding
  values enter the amax). Blocks are defined on the HF tensor, never on a Megatron shard: a
  tensor-parallel shard of q/k/v or gate/up does not start on a block boundary in general, so
  quantization runs after the export has assembled the HF tensor (on the device, in cached
  buffers), or, for q/k/v selected from the fused QKV without tensor parallelism, on the
  selection's row runs in place when each run is whole block rows of the HF tensor (the same
  blocks; ``quantize_buckets``).
* **Scale.** ``scale_inv = amax(|block|) / 448`` in fp32 (448 = the largest e4m3fn value), so the
  block's largest element maps to +-448. ``amax`` is exact (a max of bf16 values widened to
  fp32); the division is IEEE round-to-nearest (never a multiply by a reciprocal: PyTorch's CUDA
  division by a Python scalar does that, so the torch path divides by a device tensor).
* **All-zero block.** ``scale_inv = 1.0`` (any value dequantizes zeros to zero; 1.0 keeps the
  scale finite and the tensor free of 0/0).
* **Quantization.** ``q = e4m3fn(clamp(x_fp32 / scale_inv, -448, 448))``: an IEEE fp32 division,
  a clamp (``|x| / scale_inv`` can exceed 448 by one ulp), and round-to-nearest-even into e4m3fn.
  The division (not a multiply by ``448 / amax``) is what makes CPU, CUDA and the Triton kernel
  agree bit for bit. NaN or inf in a block make that block's scale NaN/inf (not checked: it
  would cost a device sync per tensor).
* **What is quantized.** 2-D ``*.weight`` tensors of linear layers; names matching
  ``BlockwiseFP8Config.keep_patterns`` stay in their dtype and are listed in the config's
  ``modules_to_not_convert``. By default the patterns are the model family's (``fp8.keep``:
  what its published FP8 checkpoint keeps, e.g. embeddings, output layer, norms, MoE routers,
  vision towers), picked by ``for_architecture``.

The package: ``format`` (this), ``keep`` (the per-family keep table), ``plan`` (the FP8 export
plan), ``reference`` (the torch quantizer that defines the bits), ``kernels`` (Triton kernels
that reproduce them on CUDA), ``quantize`` (the export transform) and ``te`` (Transformer Engine
FP8 parameters as sources).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mbridge_refit.errors import InputError
from mbridge_refit.fp8.keep import keep_patterns_for

if TYPE_CHECKING:
    from mbridge_refit.plan.entries import ExportPlan

__all__ = [
    "BLOCK",
    "BlockwiseFP8Config",
    "E4M3_MAX",
    "FP8FormatError",
    "FP8Pair",
    "FP8_DTYPE",
    "FP8_DTYPE_NAME",
    "SCALE_DTYPE",
    "SCALE_DTYPE_NAME",
    "SCALE_SUFFIX",
    "Scratch",
    "row_piece",
    "scale_box",
    "scale_name",
    "scale_shape",
]

BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8Pair = tuple[torch.Tensor, torch.Tensor]  # what a quantizer returns: (e4m3fn data, fp32 scale_inv)
Scratch = torch.Tensor | None  # a quantizer's preallocated output or work buffer; None: allocate one
SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv
FP8_DTYPE_NAME = str(FP8_DTYPE).removeprefix("torch.")  # as plan entries name dtypes
SCALE_DTYPE_NAME = str(SCALE_DTYPE).removeprefix("torch.")


class FP8FormatError(InputError):
    """A model or option that cannot be exported as blockwise FP8 (the message says why and what to do)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockwiseFP8Config:
    """What to quantize and how an engine will shard it.

    Args:
        keep_patterns: ``fnmatch`` patterns of HF names that stay in their source dtype; None
            (the default) means the model family's (``fp8.keep``), which the bridge fills in
            with ``for_architecture`` before any use.
        engine_tp_size: if set, check that an inference engine running at this tensor-parallel
            size can shard every quantized weight on block boundaries (vLLM requires each
            output partition of q/k/v, gate/up and column-parallel weights, and each input
            partition of row-parallel weights, to be a multiple of 128).
    """

    keep_patterns: tuple[str, ...] | None = None
    engine_tp_size: int | None = None

    def for_architecture(self, architecture: str | None) -> "BlockwiseFP8Config":
        """This config with the keep patterns of ``architecture`` (an HF ``architectures[0]``)
        filled in, unless patterns were given (explicit patterns win)."""
        if self.keep_patterns is not None:
            return self
        return dataclasses.replace(self, keep_patterns=keep_patterns_for(architecture))

    def quantizes(self, hf_name: str, shape: tuple[int, ...], dtype: str) -> bool:
        """Whether the export turns this HF tensor into FP8 data + scales."""
        if self.keep_patterns is None:
            raise FP8FormatError(
                "this BlockwiseFP8Config has no keep_patterns yet: call config.for_architecture(hf_architecture) "
                "(RefitBridge.fp8_config does) or pass keep_patterns="
            )
        return (
            len(shape) == 2
            and hf_name.endswith(".weight")
            and getattr(torch, dtype).is_floating_point
            and not any(fnmatch.fnmatchcase(hf_name, p) for p in self.keep_patterns)
        )

    def quantization_config(self, plan: "ExportPlan") -> dict[str, Any]:
        """The ``quantization_config`` entry of an HF FP8 ``config.json`` for ``plan``."""
        kept = sorted(
            e.hf_name[: -len(".weight")]
            for e in plan.entries
            if len(e.shape) == 2 and e.hf_name.endswith(".weight") and not self.quantizes(e.hf_name, e.shape, e.dtype)
        )
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": kept,
        }


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))


def scale_box(box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The blocks of the scale tensor that cover ``box`` (one ``(start, stop)`` per dimension of a
    weight): ``start // 128`` to ``ceil(stop / 128)``. Where ``box`` starts on a block and ends on
    one or at the tensor's end, quantizing the box alone gives exactly these scales."""
    return tuple((start // BLOCK, math.ceil(stop / BLOCK)) for start, stop in box)


def scale_name(hf_name: str) -> str:
    return hf_name + SCALE_SUFFIX


def row_piece(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, x_row: int, q_row: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` rows of the quantized tensor ``q`` from ``q_row`` (a block row) and their scales,
    read from ``x`` at ``x_row``: a ``(source, q, scale)`` job of its own whose blocks are the
    tensor's (views; a run of q/k/v in the fused QKV, or a chunk of a grouped launch)."""
    return x.narrow(0, x_row, rows), q.narrow(0, q_row, rows), scale.narrow(0, q_row // BLOCK, math.ceil(rows / BLOCK))
