"""Build a Megatron model for a bridge and a parallel layout, on CPU (gloo) or GPU.

CPU builds use Megatron's local layer spec (Transformer Engine layers need CUDA), every fused
kernel off, and are created on the meta device and then materialised empty on the CPU: the
weights are loaded right after (``loader.load_hf_weights``), which fills every parameter and
checks that none was left out. GPU builds use the Transformer Engine spec and the bridge's
defaults.

Layer specs on CPU (``cpu_layer_spec``): the bridge's default Transformer Engine spec becomes its
local spec; a spec built with a ``use_transformer_engine`` switch (Megatron's decoder block spec:
multi-latent attention, grouped experts, dense first layers) and the hybrid block spec of
experimental attention variants (gated delta net) are built as their Transformer Engine spec with
local modules and CPU stand-ins, the GPU build's parameters (``models.cpu_specs``); the former keep
the provider's ``moe_grouped_gemm`` (grouped experts, as on the GPU). A family's own spec is kept
otherwise, and the whole CPU build runs inside ``cpu_specs.te_modules_built_local``: a Transformer
Engine module the spec names (Gemma 2 and 3, MiniMax-M2, ERNIE 4.5), or that a provider builds out
of the spec's reach (the Qwen3-VL and Qwen3.5 towers, Gemma 3's vision projector), is constructed
as its local stand-in with the same parameters, and one without a stand-in fails naming itself.
Parts a provider builds with their own ``TransformerConfig`` (Gemma 3's vision projector) get the
provider's CPU initialisation settings (``nested_transformer_configs``).

Weights-only builds on CPU (``BuildOptions(weights_only=True)``: conversion, export, conformance
checks, never a forward). Two things a CPU build cannot do do not change what any parameter
holds, so such builds work around them: provider settings without a torch implementation are
set to the value in ``CPU_WEIGHT_ONLY_CONCESSIONS`` (zero-centered norm gamma: the stored tensor is
the same, only the forward reads it as ``1 + gamma``), and on a machine without CUDA the few
buffers Megatron-Core always allocates at ``torch.cuda.current_device()`` (the MoE router's
expert-bias buffers) are allocated on the CPU (``cuda_device_queries_answer_cpu``). A build that
runs the forward (``convert verify-refit``) takes neither and fails naming what it needs.

Context parallelism on CPU. On CPU the model is built with the local layer spec, whose attention supports only
``context_parallel_size == 1`` (Megatron asserts it). A CPU build at ``layout.cp > 1`` therefore
creates Megatron's process groups with the real CP size (``launch.init_model_parallel``) but
gives the model config ``context_parallel_size = 1``. This is sound for export and conversion:
context parallelism splits sequences, not weights, so every parameter's shape and every
tensor/pipeline/expert shard is the same as in a CP model, and every CP rank holds exactly what
its tensor/pipeline peers in the other CP ranks hold. Only a forward pass would differ (it would
not split the sequence), and CPU builds never run one at CP > 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from mbridge_refit.plan.layout import ParallelLayout

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

__all__ = [
    "BuildOptions",
    "CPU_PROVIDER_OVERRIDES",
    "CPU_WEIGHT_ONLY_CONCESSIONS",
    "FLOAT32_PARAMETERS",
    "build_model",
    "configure_provider",
    "cpu_concessions",
    "cpu_hybrid_stack_spec",
    "cpu_layer_spec",
    "cuda_device_queries_answer_cpu",
    "keeping_parameter_attributes",
    "materialize",
    "nested_transformer_configs",
]

logger = logging.getLogger(__name__)

# Settings that have no CPU implementation (or need apex / CUDA streams). Applied to CPU builds.
CPU_PROVIDER_OVERRIDES: dict[str, Any] = {
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "cross_entropy_loss_fusion": False,
    "moe_permute_fusion": False,
    "moe_grouped_gemm": False,  # the local spec's grouped MLP needs the grouped_gemm package (TE specs keep it: cpu_layer_spec)
    "moe_token_dispatcher_type": "allgather",
    "moe_shared_expert_overlap": False,  # needs the alltoall or flex dispatcher
    "fused_residual_rmsnorm": False,  # a Transformer Engine norm
}

# Parameters Megatron-Core creates in float32 whatever params_dtype says (module class name ->
# parameter names): the CPU build's cast to the checkpoint dtype leaves them, so they are what the
# GPU build holds (and exports). The Mamba mixer keeps A_log and D in fp32 (megatron/core/ssm/mamba_mixer.py).
FLOAT32_PARAMETERS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "MambaMixer": ("A_log", "D"),
    }
)

# Provider settings a CPU build cannot honour that change the forward, not the weights:
# field -> (the value weights-only CPU builds use, what that changes).
CPU_WEIGHT_ONLY_CONCESSIONS: Mapping[str, tuple[Any, str]] = MappingProxyType(
    {
        "layernorm_zero_centered_gamma": (False, "torch norms lack it; it changes the forward, not the weights"),
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildOptions:
    """How to build the model.

    Attributes:
        device: ``cpu`` or ``cuda``; decides the layer spec and process-group backend.
        params_dtype: parameter dtype; None = the HF checkpoint's ``torch_dtype``.
        materialize: CPU only; False keeps the model on the meta device (for plans of huge shapes).
        fp8_param_recipe: GPU only; keep the linear weights as Transformer Engine FP8 parameters
            with this Megatron ``fp8_recipe`` (e.g. ``"blockwise"``: 128x128 e4m3 blocks), as an
            FP8 trainer does (``fp8="e4m3"``, ``fp8_param=True``).
        provider_overrides: provider fields set last (after the layout and device settings).
        weights_only: the model only moves weights and never runs a forward; a CPU build then
            takes ``CPU_WEIGHT_ONLY_CONCESSIONS`` (module docstring: weights-only builds on CPU).
    """

    device: torch.device
    params_dtype: torch.dtype | None = None
    materialize: bool = True
    fp8_param_recipe: str | None = None
    provider_overrides: Mapping[str, Any] = MappingProxyType({})
    weights_only: bool = False


def configure_provider(provider: Any, layout: ParallelLayout, options: BuildOptions) -> Any:
    """Apply ``layout`` and device-specific settings to a Megatron-Bridge model provider."""
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.virtual_pipeline_model_parallel_size = layout.vpp if layout.pp > 1 else None
    provider.expert_model_parallel_size = layout.ep
    provider.expert_tensor_parallel_size = layout.etp
    provider.context_parallel_size = (
        layout.cp if options.device.type == "cuda" else 1
    )  # module docstring: context parallelism on CPU
    provider.sequence_parallel = False
    provider.gradient_accumulation_fusion = False  # needs apex; these builds never train
    provider.num_layers_in_first_pipeline_stage = layout.first_stage_layers
    provider.num_layers_in_last_pipeline_stage = layout.last_stage_layers
    if options.params_dtype is not None:
        provider.params_dtype = options.params_dtype
        provider.bf16 = options.params_dtype == torch.bfloat16
        provider.fp16 = options.params_dtype == torch.float16
    if options.fp8_param_recipe is not None:
        if options.device.type != "cuda":
            raise ValueError("FP8 parameters need Transformer Engine's CUDA kernels: build on a GPU (device='cuda').")
        provider.fp8 = "e4m3"
        provider.fp8_recipe = options.fp8_param_recipe
        provider.fp8_param = True
    if options.device.type == "cpu":
        grouped_experts = getattr(provider, "moe_grouped_gemm", False)
        for name, value in CPU_PROVIDER_OVERRIDES.items():
            if hasattr(provider, name):
                setattr(provider, name, value)
        if hasattr(provider, "transformer_layer_spec"):
            provider.transformer_layer_spec = cpu_layer_spec(provider.transformer_layer_spec)
            if _builds_transformer_engine_spec(provider.transformer_layer_spec):
                provider.moe_grouped_gemm = grouped_experts  # TE's grouped linear has a CPU stand-in
        if hasattr(provider, "hybrid_stack_spec"):  # hybrid (Mamba) providers build their own stack
            provider.hybrid_stack_spec = cpu_hybrid_stack_spec(provider.hybrid_stack_spec)
    if options.weights_only and options.device.type == "cpu":
        concessions = cpu_concessions(provider)
        if concessions:
            logger.info("CPU build for weights only: %s (module docstring: weights-only builds on CPU)", concessions)
        for name, value in concessions.items():
            setattr(provider, name, value)
    for name, value in options.provider_overrides.items():
        setattr(provider, name, value)
    provider.finalize()
    return provider


def cpu_layer_spec(spec: Any) -> Any:
    """The spec to build ``spec``'s layers with on CPU (module docstring: layer specs on CPU)."""
    from megatron.bridge.models import gpt_provider
    from megatron.core.models.gpt import (
        experimental_attention_variant_module_specs as experimental,
    )

    from mbridge_refit.models import cpu_specs

    if spec in (gpt_provider.default_layer_spec, gpt_provider.transformer_engine_layer_spec):
        return gpt_provider.local_layer_spec
    if spec is experimental.get_transformer_block_with_experimental_attention_variant_spec:
        return cpu_specs.experimental_attention_block_spec
    if isinstance(spec, functools.partial) and spec.keywords.get("use_transformer_engine"):
        return functools.partial(cpu_specs.transformer_engine_block_spec, spec)
    logger.debug("layer spec %r has no known CPU variant: kept", spec)
    return spec


def _builds_transformer_engine_spec(spec: Any) -> bool:
    from mbridge_refit.models import cpu_specs

    return isinstance(spec, functools.partial) and spec.func is cpu_specs.transformer_engine_block_spec


def cpu_hybrid_stack_spec(configured: Any) -> Any:
    """The ``hybrid_stack_spec`` a hybrid (Mamba) provider builds its stack with on CPU: a builder
    the provider calls with itself (``models.cpu_specs.hybrid_stack_spec``)."""
    from mbridge_refit.models import cpu_specs

    return functools.partial(cpu_specs.hybrid_stack_spec, configured)


def build_model(bridge: AutoBridge, layout: ParallelLayout, options: BuildOptions) -> list[torch.nn.Module]:
    """Build the model chunks (one per virtual stage) for this rank; weights are uninitialised.

    Call on every rank after ``distributed.init_model_parallel(layout)``. On CPU the chunks are
    materialised with ``to_empty``: load weights into them before use.
    """
    from mbridge_refit.models import cpu_specs

    provider = configure_provider(bridge.to_megatron_provider(load_weights=False), layout, options)
    on_cpu = options.device.type == "cpu"
    provider.perform_initialization = not on_cpu
    if on_cpu:
        for config in nested_transformer_configs(provider):  # provide_distributed_model sets the provider's only
            config.use_cpu_initialization = True
            config.perform_initialization = False
    no_cuda = on_cpu and options.weights_only and not torch.cuda.is_available()
    with contextlib.ExitStack() as build_context:
        if on_cpu:
            build_context.enter_context(cpu_specs.te_modules_built_local())
        if no_cuda:
            build_context.enter_context(cuda_device_queries_answer_cpu())
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=on_cpu,
            init_model_with_meta_device=on_cpu,
            mixed_precision_wrapper=None,
        )
    if on_cpu and options.materialize:
        chunks = materialize(chunks)
    if on_cpu and options.params_dtype is not None:
        # The local spec builds its torch norms in fp32 whatever params_dtype says; on this
        # conversion path every parameter takes the checkpoint's dtype so exports keep it,
        # but those Megatron-Core keeps in float32 on any device (FLOAT32_PARAMETERS).
        chunks = [
            keeping_parameter_attributes(chunk, lambda c: _to_params_dtype(c, options.params_dtype)) for chunk in chunks
        ]
    return chunks


def materialize(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """CPU chunks built with ``materialize=False`` (on the meta device) given uninitialised CPU
    memory, as ``build_model`` returns them with ``materialize=True`` (the dtype conversion of
    ``params_dtype`` done on the meta device carries over: ``to_empty`` keeps each dtype)."""
    return [keeping_parameter_attributes(chunk, lambda c: c.to_empty(device="cpu")) for chunk in chunks]


def keeping_parameter_attributes(chunk: torch.nn.Module, convert: Any) -> torch.nn.Module:
    """``convert(chunk)`` with each parameter's Python attributes as they were before.

    Megatron marks parameters with what they are (``tensor_model_parallel``, ``partition_dim``,
    ``allreduce`` for expert-parallel ones, ...); a conversion that replaces the parameter objects
    (``to_empty`` from the meta device does) would drop them, and readers of these marks (the
    bridge's broadcasts, the conformance checks' per-shard random values) would take every
    parameter for a replicated one.
    """
    marks = {name: dict(vars(param)) for name, param in chunk.named_parameters()}
    converted = convert(chunk)
    for name, param in converted.named_parameters():
        for attribute, value in marks[name].items():
            setattr(param, attribute, value)
    return converted


def nested_transformer_configs(provider: Any) -> list[Any]:
    """The Megatron ``TransformerConfig``s a provider holds for parts it builds with their own config
    (Gemma 3's vision projector): a CPU build sets their initialisation settings as the provider's."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = (getattr(provider, field.name, None) for field in dataclasses.fields(provider))
    return [value for value in values if isinstance(value, TransformerConfig) and value is not provider]


def _to_params_dtype(chunk: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``chunk`` in ``dtype``, with ``FLOAT32_PARAMETERS`` back in float32 (as the GPU build holds
    them; values are not kept: CPU builds are filled after this)."""
    chunk = chunk.to(dtype=dtype)
    for module in chunk.modules():
        for name in FLOAT32_PARAMETERS.get(type(module).__name__, ()):
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.data = param.data.float()
    return chunk


def cpu_concessions(provider: Any) -> dict[str, Any]:
    """The ``CPU_WEIGHT_ONLY_CONCESSIONS`` whose field ``provider`` sets to another value."""
    return {
        field: value
        for field, (value, _) in CPU_WEIGHT_ONLY_CONCESSIONS.items()
        if hasattr(provider, field) and getattr(provider, field) != value
    }


@contextlib.contextmanager
def cuda_device_queries_answer_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` returns ``"cpu"`` and the CUDA RNG tracker's ``fork`` does
    nothing inside the block (a machine without CUDA).

    Megatron-Core allocates a few buffers with ``device=torch.cuda.current_device()`` whatever
    ``use_cpu_initialization`` says (the MoE router's expert-bias buffers, the Mamba mixer's
    ``conv1d``, ``dt_bias``, ``A_log``, ``D`` and norm); without a driver that call raises, so
    those families could not be built on CPU at all. The Mamba mixer also draws its initial values
    inside ``get_cuda_rng_tracker().fork()``, which reads and sets the CUDA RNG state: Megatron's
    inference tracker (whose ``fork`` is a no-op) stands in while the model is built, and the
    tracker there was before is back afterwards. Weights-only builds overwrite every value.
    """
    from megatron.core.tensor_parallel import random as megatron_random

    current_device = torch.cuda.current_device
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    torch.cuda.current_device = lambda: "cpu"
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        torch.cuda.current_device = current_device
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker
