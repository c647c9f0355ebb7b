"""A vLLM-like engine worker at tensor parallelism > 1, for CPU tests of the sharded colocated refit.

``TPEngine(shapes, config, rank=r, tp=n)`` holds engine rank r's parameters laid out as vLLM lays
out Qwen3 / Qwen3-MoE at ``tensor_parallel_size=n`` (without expert parallelism, vLLM's default:
each expert's intermediate dimension split like a dense MLP), and loads full-size HF tensors with
loaders that mirror vLLM 0.26's (quoted per loader below): each narrows the full tensor to rank
r's part. Norms go through a temporary (not vLLM's plain copy: so that a tensor the refit must load
through the loader every step is exercised). ``full_size`` names HF modules whose engine parameter
is left whole and copied whole (an engine running another layout than the plan's for them).

``quantized`` names the HF weights the engine holds as blockwise FP8 (an engine started from an FP8
checkpoint with ``weight_block_size`` [128, 128]; in vLLM the checkpoint's ``quantization_config``
decides): the parameter is ``float8_e4m3fn`` and beside it sits ``<param>_scale_inv`` (fp32, one
scale per 128x128 block of the rank's partition: vLLM's ``BlockQuantScaleParameter``), loaded from
the HF ``<name>_scale_inv`` by the same loaders counting in blocks, as vLLM's do.
"""

from __future__ import annotations

import re

import torch

__all__ = ["TPEngine", "route"]

# vLLM qwen3.py / qwen2.py ``stacked_params_mapping``: (param_name, shard_name, shard_id)
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
ROW = (".self_attn.o_proj.", ".mlp.down_proj.")
SCALE = "_scale_inv"
BLOCK = 128  # weight_block_size [128, 128]
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def route(hf_name: str) -> tuple[str, str, object]:
    """(engine parameter, loader, shard id) of an HF tensor."""
    expert = EXPERT.match(hf_name)
    if expert:
        prefix, index, part = expert.groups()
        if part == "down_proj":
            return f"{prefix}.w2_weight", "w2", int(index)
        return f"{prefix}.w13_weight", "w13", (int(index), "w1" if part == "gate_proj" else "w3")
    for param_name, shard_name, shard_id in STACKED:
        if f".{shard_name}." in hf_name:
            return hf_name.replace(shard_name, param_name), ("qkv" if param_name == "qkv_proj" else "merged"), shard_id
    if any(part in hf_name for part in ROW):
        return hf_name, "row", None
    if hf_name in VOCAB:
        return hf_name, "vocab", None
    return hf_name, "replicated", None


class TPEngine(torch.nn.Module):
    """Engine rank ``rank`` of ``tp`` (module docstring)."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], config, *, rank: int, tp: int, full_size=(), quantized=()
    ) -> None:
        super().__init__()
        self.rank, self.tp, self.full_size = rank, tp, tuple(full_size)
        self.shapes, self.quantized = dict(shapes), frozenset(quantized)
        head_dim = config.head_dim
        kv = config.num_key_value_heads
        self.replicas = max(1, tp // kv)  # QKVParallelLinear.num_kv_head_replicas
        self.q_size = config.num_attention_heads // tp * head_dim
        self.kv_size = max(1, kv // tp) * head_dim
        self.params = torch.nn.ParameterDict()
        self.org_vocab = {}
        for name, shape in shapes.items():
            target, loader, shard = route(name)
            key = target.replace(".", "__")
            if key not in self.params:
                local = self._local_shape(name, shape, loader, shapes)
                dtype = torch.float8_e4m3fn if name in self.quantized else torch.bfloat16
                self.params[key] = torch.nn.Parameter(torch.zeros(local, dtype=dtype), requires_grad=False)
                if name in self.quantized:  # (output_per_partition + 127) // 128, (input_per_partition + 127) // 128
                    blocks = (*local[:-2], *(_blocks(n) for n in local[-2:]))
                    self.params[key + SCALE] = torch.nn.Parameter(torch.ones(blocks), requires_grad=False)
            if loader == "vocab":
                self.org_vocab[name] = shape[0]

    def _local_shape(self, name, shape, loader, shapes) -> tuple[int, ...]:
        if self._whole(name):
            return tuple(shape)
        tp = self.tp
        if loader == "qkv":
            return (self.q_size + 2 * self.kv_size, shape[1])
        if loader == "merged":
            return (2 * shape[0] // tp, shape[1])
        if loader == "row":
            return (shape[0], shape[1] // tp)
        if loader == "vocab":
            return (-(-shape[0] // PADDING) * PADDING // tp, shape[1])
        if loader in ("w13", "w2"):
            experts = 1 + max(int(EXPERT.match(n).group(2)) for n in shapes if EXPERT.match(n))
            if loader == "w13":
                return (experts, 2 * shape[0] // tp, shape[1])
            return (experts, shape[0], shape[1] // tp)
        return tuple(shape)

    def _whole(self, name: str) -> bool:
        return any(part in name for part in self.full_size)

    def named_engine_parameters(self) -> dict[str, torch.Tensor]:
        return {name.replace("__", "."): p for name, p in self.params.items()}

    def load_weights(self, weights) -> None:
        for name, loaded in weights:
            target, loader, shard = route(name.removesuffix(SCALE))
            key = target.replace(".", "__") + (SCALE if name.endswith(SCALE) else "")
            param = self.params[key].data
            if self._whole(name):
                param.copy_(loaded)
            else:
                getattr(self, f"_load_{loader}")(param, loaded, shard, name)

    def _unit(self, name: str) -> int:
        """Elements per loaded row or column: a block for a scale (vLLM divides its shard offsets and
        sizes by ``weight_block_size``, rounding up, for a ``BlockQuantScaleParameter``), else 1."""
        return BLOCK if name.endswith(SCALE) else 1

    def _load_qkv(self, param, loaded, shard_id, name) -> None:
        # vllm/model_executor/parameter.py _ColumnvLLMParameter.load_qkv_weight:
        #   shard_id_int = self.tp_rank if shard_id == "q" else self.tp_rank // num_heads
        #   param_data = param_data.narrow(self.output_dim, shard_offset, shard_size)
        #   loaded_weight = loaded_weight.narrow(self.output_dim, shard_id_int * shard_size, shard_size)
        #   param_data.copy_(loaded_weight)
        # QKVParallelLinear.weight_loader_v2, for a BlockQuantScaleParameter:
        #   shard_offset = (shard_offset + block_n - 1) // block_n
        #   shard_size = (shard_size + block_n - 1) // block_n
        unit = self._unit(name)
        shard_offset, shard_size = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]
        shard_offset, shard_size = _blocks(shard_offset, unit), _blocks(shard_size, unit)
        shard_id_int = self.rank if shard_id == "q" else self.rank // self.replicas
        param.narrow(0, shard_offset, shard_size).copy_(loaded.narrow(0, shard_id_int * shard_size, shard_size))

    def _load_merged(self, param, loaded, shard_id, name) -> None:
        # _ColumnvLLMParameter.load_merged_column_weight:
        #   param_data = param_data.narrow(self.output_dim, shard_offset, shard_size)
        #   loaded_weight = loaded_weight.narrow(self.output_dim, self.tp_rank * shard_size, shard_size)
        # MergedColumnParallelLinear.weight_loader_v2: shard_size = self.output_sizes[loaded_shard_id] // tp_size,
        #   for a BlockQuantScaleParameter (shard_size + block_n - 1) // block_n (offsets alike)
        shard_size = _blocks(self.shapes[name.removesuffix(SCALE)][0] // self.tp, self._unit(name))
        param.narrow(0, shard_id * shard_size, shard_size).copy_(loaded.narrow(0, self.rank * shard_size, shard_size))

    def _load_row(self, param, loaded, shard_id, name) -> None:
        # RowvLLMParameter.load_row_parallel_weight:
        #   shard_size = self.data.shape[self.input_dim]
        #   loaded_weight = loaded_weight.narrow(self.input_dim, self.tp_rank * shard_size, shard_size)
        shard_size = param.shape[1]
        param.copy_(loaded.narrow(1, self.rank * shard_size, shard_size))

    def _load_vocab(self, param, loaded, shard_id, name) -> None:
        # VocabParallelEmbedding.weight_loader:
        #   loaded_weight = loaded_weight.narrow(output_dim, start_idx, shard_size)
        #   param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        #   param[loaded_weight.shape[0] :].data.fill_(0)
        per_rank = param.shape[0]
        start = min(self.rank * per_rank, self.org_vocab[name])
        size = min(per_rank, self.org_vocab[name] - start)
        loaded = loaded.narrow(0, start, size)
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)

    def _load_w13(self, param, loaded, shard, name) -> None:
        # fused_moe/routed_experts.py _load_w13 (shard_dim 0, is_act_and_mul):
        #   shard_size = expert_data.shape[shard_dim] // 2
        #   loaded_weight = loaded_weight.narrow(shard_dim, shard_size * tp_rank, shard_size)
        #   w1: expert_data.narrow(shard_dim, 0, shard_size); w3: .narrow(shard_dim, shard_size, shard_size)
        #   expert_data.copy_(loaded_weight)
        expert, shard_id = shard
        expert_data = param[expert]
        shard_size = expert_data.shape[0] // 2
        loaded = loaded.narrow(0, shard_size * self.rank, shard_size)
        expert_data = expert_data.narrow(0, 0 if shard_id == "w1" else shard_size, shard_size)
        expert_data.copy_(loaded)

    def _load_w2(self, param, loaded, expert, name) -> None:
        # _load_w2 (shard_dim 1): shard_size = expert_data.shape[shard_dim]
        #   loaded_weight = loaded_weight.narrow(shard_dim, shard_size * tp_rank, shard_size)
        expert_data = param[expert]
        per_rank = expert_data.shape[1]
        expert_data.copy_(loaded.narrow(1, per_rank * self.rank, per_rank))

    def _load_replicated(self, param, loaded, shard_id, name) -> None:
        if name.endswith("norm.weight"):
            param.copy_(loaded.float().to(param.dtype))  # through a temporary: loaded by the loader every step
            return
        param.copy_(loaded)  # vLLM's default_weight_loader: param.data.copy_(loaded_weight)


def _blocks(size: int, unit: int = BLOCK) -> int:
    return -(-size // unit)
