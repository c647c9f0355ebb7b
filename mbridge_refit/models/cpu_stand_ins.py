"""CPU stand-ins for Transformer Engine modules: local modules with the same parameters.

Each class here has the signature and the parameters (names, shapes, dtypes, tensor-parallel
attributes) of one Transformer Engine module, or of a Megatron-Bridge subclass of one, built from
Megatron-Core's local layers and torch: what an export reads is the same as on the GPU build.
Which stand-in replaces which class, and how a CPU build comes to construct it, is
``models.cpu_specs``'s business; ``register_stand_in_types`` tells the bridge how the stand-ins
whose class names it cannot read are placed over tensor-parallel ranks.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = [
    "ColumnParallelGroupedLinear",
    "CoreAttention",
    "Gemma3DotProductAttention",
    "Gemma4DotProductAttention",
    "LocalWindowAttention",
    "LayerNormColumnParallelLinear",
    "RowParallelGroupedLinear",
    "RowParallelLinearLayerNorm",
    "TorchNorm",
    "normalize",
    "register_stand_in_types",
]


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """A norm (``config.normalization``) followed by a column-parallel linear, on CPU.

    The signature and parameters of Transformer Engine's ``TELayerNormColumnParallelLinear``
    (``layer_norm_weight``, and ``layer_norm_bias`` for LayerNorm, replicated over tensor ranks).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon
        initial = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(initial(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        normed = normalize(
            input_, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma
        )
        return super().forward(normed, *args, **kwargs)


class TorchNorm(torch.nn.Module):
    """``TENorm`` on CPU: ``config.normalization`` over the last dimension, with the parameters of
    Transformer Engine's norms (``weight``, and ``bias`` for LayerNorm, in ``config.params_dtype``)
    and their zero-centered gamma (``1 + weight`` when ``config.layernorm_zero_centered_gamma``).
    ``has_residual`` asks for a residual fused into the norm when ``config.fused_residual_rmsnorm``
    is set, which CPU builds turn off (``models.builder.CPU_PROVIDER_OVERRIDES``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"TENorm supports LayerNorm and RMSNorm, not {config.normalization!r}")
        if has_residual and config.fused_residual_rmsnorm:
            raise ValueError("fused_residual_rmsnorm needs Transformer Engine: set it False to build on CPU.")
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = eps
        initial = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(initial(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return normalize(input_, self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)


def normalize(
    input_: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``input_``'s last dimension, the gamma ``1 + weight`` when zero-centered."""
    gamma = weight + 1 if zero_centered_gamma else weight
    shape = (input_.shape[-1],)
    if normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(input_, shape, gamma, bias, eps)
    return torch.nn.functional.rms_norm(input_, shape, gamma, eps)


class CoreAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` taking Transformer Engine's ``k_channels`` and
    ``v_channels`` (multi-latent attention's key and value head sizes differ from ``kv_channels``).

    Core attention has no parameters; the value head size sets the width of its output.
    """

    def __init__(self, *args: Any, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None and kwargs.get("softmax_scale") is None:
            self.softmax_scale = 1.0 / math.sqrt(k_channels)


class _GroupedLinear(torch.nn.Module):
    """The parameters of Transformer Engine's grouped linear (``TEGroupedLinear``), on CPU.

    One weight per local expert, ``weight0`` .. ``weight{N-1}`` (and ``bias0`` ..), split over the
    expert tensor-parallel ranks like Megatron's ``TEColumnParallelGroupedLinear`` /
    ``TERowParallelGroupedLinear`` split them, with the attributes Megatron sets on them
    (``_set_expert_parameter_attributes``): ``allreduce`` (False where gradients reduce over the
    expert data-parallel group), ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``.
    The module carries ``tensor_model_parallel`` and ``partition_dim`` too: the bridge's
    ``AutoMapping`` detects column/row placement from them as it does from TE's class names.
    The forward is not implemented: these builds move weights and run no experts.
    """

    partition_dim: int  # 0: column parallel (output features split), 1: row parallel (input features split)

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide, get_pg_size

        super().__init__()
        if not is_expert:
            raise ValueError(
                "a grouped linear holds experts (Megatron: TEGroupedLinear only supports expert parallelism)"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        tp_size = get_pg_size(pg_collection.expt_tp)
        if self.partition_dim == 0:
            output_size = divide(output_size, tp_size)
        else:
            input_size = divide(input_size, tp_size)
        self.config = config
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.tensor_model_parallel = True
        expert_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(weight)
            self._register(f"weight{i}", weight, split=True, expert_groups=expert_groups)
            if bias:
                bias_param = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
                self._register(f"bias{i}", bias_param, split=self.partition_dim == 0, expert_groups=expert_groups)

    def _register(self, name: str, param: torch.nn.Parameter, *, split: bool, expert_groups: bool) -> None:
        param.allreduce = not expert_groups
        param.tensor_model_parallel = split
        if split:
            param.partition_dim = self.partition_dim
            param.partition_stride = 1
        self.register_parameter(name, param)

    def forward(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            f"{type(self).__name__} is a CPU stand-in holding grouped expert weights for weight transfers; "
            "run the forward on a GPU build (Transformer Engine's grouped GEMM)"
        )


class ColumnParallelGroupedLinear(_GroupedLinear):
    """CPU stand-in for ``TEColumnParallelGroupedLinear`` (experts' ``linear_fc1``)."""

    partition_dim = 0


class RowParallelGroupedLinear(_GroupedLinear):
    """CPU stand-in for ``TERowParallelGroupedLinear`` (experts' ``linear_fc2``)."""

    partition_dim = 1


class RowParallelLinearLayerNorm(RowParallelLinear):
    """A row-parallel linear whose output goes through a norm (``config.normalization``), on CPU.

    The signature and parameters of Megatron-Bridge's ``TERowParallelLinearLayerNorm`` (Gemma 2 and
    3, EXAONE 4: the post-attention and post-MLP norms): the linear's ``weight`` (row parallel) and
    ``post_layernorm.weight`` (a ``TENorm`` there, replicated over tensor ranks).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = TorchNorm(config, output_size)

    def forward(self, input_: torch.Tensor):
        output, bias = super().forward(input_)
        if bias is not None:
            raise ValueError(
                "RowParallelLinearLayerNorm needs add_bias_linear=False: a deferred bias would be added after the norm."
            )
        return self.post_layernorm(output), bias


class LocalWindowAttention(DotProductAttention):
    """Core attention on CPU (no parameters) with a sliding window of ``config.window_size`` on the
    local layers of an interleaved pattern and global attention on the others; subclasses name the
    model's own test for a local layer (``is_local_layer``) and may change window and mask."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        **kwargs: Any,
    ):
        config = copy.deepcopy(config)
        local = self.is_local_layer(layer_number, config.interleaved_attn_pattern)
        config.window_size, attn_mask_type = self.window_and_mask(config, local, attn_mask_type)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, **kwargs)

    @staticmethod
    def is_local_layer(layer_number: int, pattern: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def window_and_mask(config: Any, local: bool, attn_mask_type: Any) -> tuple[Any, Any]:
        return ((config.window_size - 1, 0) if local else None), attn_mask_type


class Gemma3DotProductAttention(LocalWindowAttention):
    """Megatron-Bridge's ``Gemma3TEDotProductAttention`` on CPU: Gemma 3's local layers, and the
    vision-language model's own mask (no window, no mask type: its attention bias carries it)."""

    @staticmethod
    def is_local_layer(layer_number: int, pattern: Any) -> bool:
        from megatron.bridge.models.gemma.gemma3_provider import _is_local_attn_layer

        return _is_local_attn_layer(layer_number, pattern)

    @staticmethod
    def window_and_mask(config: Any, local: bool, attn_mask_type: Any) -> tuple[Any, Any]:
        if config.is_vision_language:
            from megatron.core.transformer.enums import AttnMaskType

            return None, AttnMaskType.no_mask
        return LocalWindowAttention.window_and_mask(config, local, attn_mask_type)


class Gemma4DotProductAttention(LocalWindowAttention):
    """Megatron-Bridge's ``Gemma4TEDotProductAttention`` (Gemma 4's MoE layers) on CPU."""

    @staticmethod
    def is_local_layer(layer_number: int, pattern: Any) -> bool:
        from megatron.bridge.models.gemma.modeling_gemma4 import _is_local_attn_layer

        return _is_local_attn_layer(layer_number, pattern)


def register_stand_in_types() -> None:
    """Tell the bridge's ``AutoMapping`` how the stand-ins without a detectable class name are
    placed: ``Linear`` (for ``TELinear``, which multi-latent attention builds duplicated) is
    replicated over tensor-parallel ranks, as the bridge detects ``TELinear(parallel_mode="duplicated")``;
    ``RowParallelLinearLayerNorm`` is row parallel, as the bridge registers
    ``TERowParallelLinearLayerNorm`` (unregistered, its name's "Norm" makes the bridge take it for a
    replicated norm: stock and the plan would agree on a wrong TP split, which the roundtrip shows)."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("Linear", "replicated")
    AutoMapping.register_module_type(RowParallelLinearLayerNorm.__name__, "row")
