"""vLLM's DeepGEMM post-processing of block-FP8 layers, as a colocated refit meets it: which layers it
reworks, their processing run again after each replay where that is exact, a refusal by name where not.

What vLLM 0.26.0 does with its defaults (paths under ``vllm/``):

* DeepGEMM is on: ``VLLM_USE_DEEP_GEMM``, ``VLLM_MOE_USE_DEEP_GEMM`` and ``VLLM_USE_DEEP_GEMM_E8M0``
  default to 1 (``envs.py:1480-1489``); ``is_deep_gemm_supported()`` is the first and a ``deep_gemm``
  module (the wheel bundles ``third_party/deep_gemm``) and an sm90, sm100 or sm120 GPU
  (``utils/deep_gemm.py:93-100``, ``platforms/cuda.py:665-671``). E8M0 is used on Hopper too
  (``is_deep_gemm_e8m0_used``, ``utils/deep_gemm.py:102-125``; scales kept as float32 powers of two on
  sm90, packed into int32 on sm100/120: ``DeepGemmQuantScaleFMT``, ``:49-82``).
* A block-FP8 linear layer with a bf16 output, N a multiple of 64 and K of 128 runs
  ``DeepGemmFp8BlockScaledMMKernel`` (``model_executor/kernels/linear/__init__.py:355-365``, or FlashInfer's
  kernel, which processes through it: ``scaled_mm/flashinfer.py:179-182``). Its
  ``process_weights_after_loading`` (``scaled_mm/deep_gemm.py:84-107``) calls
  ``deepgemm_post_process_fp8_weight_block`` (``layers/quantization/utils/fp8_utils.py:1090-1153``): with
  E8M0 and float32 scales, ``requant_weight_ue8m0_inplace`` (``:990-1047``) dequantizes the weight with its
  scales and quantizes it again with power-of-two scales (``per_block_cast_to_fp8``,
  ``utils/deep_gemm.py:644-680``: ``2^ceil(log2(max(amax, 1e-4) / 448))``), in place: a weight exported with
  ``amax / 448`` scales, and an all-zero block's scale of 1, come out with other bytes. The scale then goes
  through DeepGEMM's ``transform_sf_into_required_layout``: on sm90 a float32 scale of 128x128 blocks is
  checked and kept as it is; on sm100/120 it becomes a new int32 tensor of packed UE8M0 scales, MN-major
  and TMA-aligned, of another shape. ``replace_parameter`` (``model_executor/utils.py:47-98``) wraps the
  results in new Parameters. Requantizing its own output does not always give the same bytes (a block
  whose largest code rounded to 224 is scaled again), so the processing must start from the loaded bytes.
* Block-FP8 MoE at tensor parallelism on Hopper picks the Triton experts
  (``layers/fused_moe/oracle/fp8.py:112-122``), which keep the bytes. DeepGEMM's experts are picked when
  ``VLLM_USE_DEEP_GEMM`` or ``VLLM_MOE_USE_DEEP_GEMM`` is *set* and neither is 0 (``:358-372``; unset is
  not the same), or by priority otherwise (expert parallelism without FlashInfer's CUTLASS experts); their processing
  requantizes every expert the same way (``fp8_utils.py:1156-1176``, ``oracle/fp8.py:469-477``) and
  builds the experts' kernel again (``layers/quantization/fp8.py`` ``Fp8MoEMethod._setup_kernel``).
* vLLM's own reload (``model_executor/model_loader/reload/layerwise.py``) loads a layer into fresh staging
  tensors in the checkpoint's format, runs its ``quant_method.process_weights_after_loading`` there and
  copies the results into the tensors the engine computes with (``:335-379``): processing always starts
  from loaded bytes, which is why vLLM's weight updates work with DeepGEMM on.

A refit does the same in its own order. The recorder (``engines.replay.apply_plan``) finds the parameters
whose staged bytes processing wrote over (*processed*); the replay copies the exported bytes into them,
and ``reprocess`` is the layer's processing run again on them after the copies, as vLLM's reload runs it
(``layerwise.py:363-371``), the same function of the same bytes, so the bytes of an engine loaded from a
checkpoint of the same weights; the open's check proves it. It costs one requantization of every such
layer per step, on the engine's GPU. A processing that moved a parameter elsewhere fails the step by name.

``refuse_unsupported`` refuses, before an open maps or loads anything, what this cannot redo: DeepGEMM's
MoE experts (a kernel built again per step, every expert requantized in a Python loop) and linear layers
whose scales DeepGEMM re-laid out (sm100/120: the exported float32 scales have nowhere to go).

Layers are found by class and value names (``DeepGemmFp8BlockScaledMMKernel`` among the bases of a
layer's ``quant_method.fp8_linear`` or of its ``fallback``; an ``Fp8MoeBackend`` value), so this module
imports no vLLM and CPU stand-ins named like vLLM's are found as vLLM's are.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mbridge_refit.engines.ipc.engine import EngineRefitError

__all__ = [
    "DEEP_GEMM_KERNEL",
    "DEEP_GEMM_MOE_BACKENDS",
    "deep_gemm_experts",
    "deep_gemm_linear",
    "refuse_unsupported",
    "reprocess",
]

DEEP_GEMM_KERNEL = "DeepGemmFp8BlockScaledMMKernel"  # scaled_mm/deep_gemm.py:32
DEEP_GEMM_MOE_BACKENDS = frozenset({"DEEPGEMM", "BATCHED_DEEPGEMM"})  # Fp8MoeBackend values, oracle/fp8.py:46-47


def deep_gemm_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose FP8 kernel is DeepGEMM's (its processing is then DeepGEMM's)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return any(
        candidate is not None and any(cls.__name__ == DEEP_GEMM_KERNEL for cls in type(candidate).__mro__)
        for candidate in (kernel, getattr(kernel, "fallback", None))
    )


def deep_gemm_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an MoE layer running DeepGEMM's FP8 experts."""
    backend = getattr(getattr(module, "quant_method", None), "fp8_backend", None)
    return getattr(backend, "value", backend) in DEEP_GEMM_MOE_BACKENDS


def refuse_unsupported(model: torch.nn.Module) -> None:
    """Raise ``EngineRefitError`` naming the layers of ``model`` whose DeepGEMM processing a refit cannot
    redo (module docstring), and the engine setting that avoids it; nothing when there are none."""
    experts, relaid = [], []
    for name, module in model.named_modules():
        if deep_gemm_experts(module):
            experts.append(name)
        elif deep_gemm_linear(module):
            layout = _relaid_scale(module)
            if layout is not None:
                relaid.append(f"{name} ({layout})")
    if not experts and not relaid:
        return
    parts = []
    if experts:
        parts.append(
            f"{len(experts)} MoE layer(s) run DeepGEMM's FP8 experts, e.g. {experts[:3]}: their processing "
            "requantizes every expert after loading and builds their kernel again, which a refit does not redo; "
            "start the engine with VLLM_MOE_USE_DEEP_GEMM=0 (its dense layers keep DeepGEMM)"
        )
    if relaid:
        parts.append(
            f"{len(relaid)} linear layer(s) hold scales DeepGEMM re-laid out, e.g. {relaid[:3]} (packed UE8M0 "
            "scales, as on Blackwell): the exported float32 scales have nowhere to go; start the engine with "
            "VLLM_USE_DEEP_GEMM=0"
        )
    raise EngineRefitError(
        "this vLLM engine's FP8 layers are post-processed by DeepGEMM in a way a refit cannot redo: "
        + "; ".join(parts)
        + " (VLLM_USE_DEEP_GEMM=0 turns DeepGEMM off for both)"
    )


def reprocess(module: torch.nn.Module) -> Callable[[], None] | None:
    """For a DeepGEMM linear layer, its processing run again on its parameters as they are, the way vLLM's
    reload runs it on a loaded layer (``quant_method.process_weights_after_loading``, then
    ``update_param_tp_status``): ``engines.replay.apply_plan.Recompute``'s answer, run after each replay's copies
    wrote the exported bytes. Raises ``EngineRefitError`` when it left a parameter in other memory (the
    replay's copies would then miss it). None for any other module."""
    if not deep_gemm_linear(module):
        return None
    quant_method = module.quant_method

    def run() -> None:
        before = _storages(module)
        quant_method.process_weights_after_loading(module)
        update = getattr(module, "update_param_tp_status", None)
        if update is not None:
            update()
        after = _storages(module)
        if after != before:
            moved = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
            raise EngineRefitError(
                f"DeepGEMM's processing of {type(module).__name__} left its parameters {moved} in other memory: "
                "a refit's copies would miss them; start the engine with VLLM_USE_DEEP_GEMM=0"
            )

    return run


def _storages(module: torch.nn.Module) -> dict[str, int]:
    """Each parameter of ``module`` (not its children) and the address of its storage (no subclass dispatch)."""
    with torch._C.DisableTorchFunctionSubclass():
        return {name: p.untyped_storage().data_ptr() for name, p in module._parameters.items() if p is not None}


def _relaid_scale(module: torch.nn.Module) -> str | None:
    """The dtype and shape of ``module``'s weight scale when they are not the checkpoint's (float32, one per
    block of the weight: ``weight_block_size``), else None."""
    weight = getattr(module, "weight", None)
    scale = getattr(module, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(module, "weight_scale", None)
    block = getattr(module, "weight_block_size", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor) or not block or weight.dim() != 2:
        return None
    grid = tuple(math.ceil(size / step) for size, step in zip(weight.shape, block))
    if scale.dtype == torch.float32 and tuple(scale.shape) == grid:
        return None
    return f"{str(scale.dtype).removeprefix('torch.')} {tuple(scale.shape)}, not float32 {grid}"
