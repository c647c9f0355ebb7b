"""Which weights the blockwise FP8 export keeps in high precision, per model family (data only).

A family's row follows its published FP8 checkpoint where one exists, and what vLLM 0.26 builds
without a quantization method (``quant_config=None``, ``GateLinear``, plain ``nn.Linear``): such
a layer cannot load FP8 data, so it must stay in its dtype whatever a checkpoint says. Patterns
are ``fnmatch`` patterns of HF names (``*`` also crosses dots). Only 2-D ``*.weight`` tensors are
ever quantized, so 1-D norms and biases stay in their dtype whatever the patterns say.

``KEEP_DEFAULT`` is the safe default for a family without a published FP8 checkpoint (and the
base of every row): embeddings, output layers, norms, MoE routers in each naming the registered
bridges export, multi-token-prediction input projections, and vision/audio encoders with their
projectors. ``keep_patterns_for(architecture)`` picks the row of an HF ``architectures[0]``.

Sources (read for this table; ``docs/fp8.md`` repeats them):

* deepseek-ai/DeepSeek-V3, tensor list of its safetensors (github simpx/model-inspect README):
  q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, dense/shared/routed MLPs F8_E4M3
  with ``weight_scale_inv``; embed_tokens, norms, MTP ``eh_proj`` and ``shared_head.head`` BF16.
  vLLM: ``deepseek_v2.py`` router is a ``GateLinear`` (unquantized), ``deepseek_mtp.py``
  ``eh_proj`` an ``nn.Linear``.
* moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, shipped in FP8 (github
  AI-Hypercomputer/maxtext tests/end_to_end/tpu/kimi/Run_Kimi.md, whose converter dequantizes
  it); Kimi-K2.5/K2.6 ship int4 experts with everything else BF16 (same file), not FP8.
* MiniMaxAI/MiniMax-M2, checkpoint dtypes (github whn09/neuronx-distributed-inference
  examples/minimax_m2_misc/SUMMARY.md): attention and experts FP8; router ``gate`` fp32;
  lm_head, embeddings, norms BF16. vLLM ``minimax_m2.py``: the gate is a ``GateLinear``.
* zai-org/GLM-5.3 (FP8-block; llm-compressor's GLM-5.3 MXFP4 example lists what its source left
  unquantized): ``mlp.gate``, ``lm_head``, ``embed_tokens``, ``eh_proj``,
  ``self_attn.indexer.weights_proj``. vLLM ``deepseek_v2.py`` fuses the indexer's wk and
  weights_proj into one layer built with ``quant_config=None``.
* Qwen/Qwen3.6-35B-A3B-FP8 (its modules_to_not_convert as described by a re-quantization that
  copies it, friendli.ai gsting/Qwen3.6-35B-A3B-abliterated-FP8): lm_head, embed_tokens, norms,
  ``linear_attn`` ``in_proj_a``/``in_proj_b``/``in_proj_ba``/``conv1d`` and the vision tower
  kept. vLLM ``qwen3_next.py``: router ``gate`` and ``shared_expert_gate`` built with
  ``quant_config=None``; ``qwen3_moe.py``: ``shared_expert_gate`` likewise.
* gpt-oss: no FP8 checkpoint (openai/gpt-oss-* ship MXFP4 experts). vLLM ``gpt_oss.py`` builds
  ``mlp.router`` with ``quant_config=None``.
* Step-3.5-Flash, MiMo-V2, Ernie 4.5, OLMoE, EXAONE MoE: vLLM builds the router with
  ``quant_config=None`` or as a ``GateLinear`` (``step3p5.py``, ``mimo_v2_mtp.py`` for
  ``eh_proj``, ``ernie45_moe.py``, ``olmoe.py``, ``exaone_moe.py``); their published FP8
  configs were not read here.
* Vision/audio encoders: vLLM passes the FP8 config to them (``qwen2_5_vl.py``, ``qwen3_vl.py``,
  ``gemma3_mm.py``, ``mistral3.py``), so they load FP8 only if the checkpoint quantizes them; the
  published Qwen FP8 VLMs keep the tower (above), and FP8 encoders broke multimodal inputs of
  Qwen3-Omni in vllm-project/vllm-omni#2686. Kept by default.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = [
    "DSA_INDEXER_WEIGHTS",
    "EMBEDDINGS",
    "ENCODERS",
    "GATED_DELTA_NET_SMALL_PROJECTIONS",
    "KEEP_BY_ARCHITECTURE",
    "KEEP_DEFAULT",
    "MTP_INPUT_PROJECTIONS",
    "NORMS",
    "OUTPUT_LAYERS",
    "ROUTERS",
    "keep_patterns_for",
]

EMBEDDINGS = ("*embed_tokens.weight", "*backbone.embeddings.weight", "*word_embeddings.weight", "embed.weight")
OUTPUT_LAYERS = ("*lm_head.weight", "head.weight", "*.shared_head.head.weight", "diffusion_head.weight")
NORMS = ("*norm.weight",)
ROUTERS = (
    "*.mlp.gate.weight",  # DeepSeek, Qwen MoE, GLM, Ernie, OLMoE, EXAONE MoE, MiMo, Sarvam, Kimi
    "*.mlp.shared_expert_gate.weight",  # Qwen2/3 MoE, Qwen3-Next, Qwen3.5 MoE
    "*.mlp.router.weight",  # gpt-oss
    "*.mlp.router.gate.weight",  # HY-V3 (vLLM hy_v3.py: a GateLinear)
    "*.block_sparse_moe.gate.weight",  # MiniMax-M2/M3 (Mixtral naming)
    "*.moe.gate.weight",  # Step-3.5, Step-3.7
    "*.mixer.gate.weight",  # Nemotron-H
    "*.ffn.gate.weight",  # DeepSeek-V4
    "*.router.proj.weight",  # Gemma 4
)
# Multi-token-prediction layers' projection of [embedding; hidden state]: DeepSeek-V3 keeps it in
# BF16 and vLLM builds it unquantized for DeepSeek (nn.Linear), MiMo (nn.Linear) and MiMo-V2
# (ReplicatedLinear without quant_config); Qwen3-Next / EXAONE name it ``mtp.fc``.
MTP_INPUT_PROJECTIONS = ("*.eh_proj.weight", "mtp.fc.weight", "*.mtp_layers.*.input_proj.weight")
ENCODERS = (  # vision and audio towers with their projectors into the language model
    "*visual.*",
    "*vision_tower.*",
    "*vision_model.*",
    "*audio_tower.*",
    "*sound_encoder.*",
    "sound_projection.*",
    "*multi_modal_projector.*",
    "mm_projector.*",
    "patch_merge_mlp.*",
    "mlp1.*",
    "vit_large_projector.weight",
    "model.resampler_model.*",
    "*embed_vision.*",
    "*embed_audio.*",
)
KEEP_DEFAULT = EMBEDDINGS + OUTPUT_LAYERS + NORMS + ROUTERS + MTP_INPUT_PROJECTIONS + ENCODERS

GATED_DELTA_NET_SMALL_PROJECTIONS = (
    "*.linear_attn.in_proj_ba.weight",
    "*.linear_attn.in_proj_a.weight",
    "*.linear_attn.in_proj_b.weight",
)
DSA_INDEXER_WEIGHTS = ("*.self_attn.indexer.weights_proj.weight",)

# HF architecture -> patterns kept; a row per family whose published FP8 checkpoint was read.
KEEP_BY_ARCHITECTURE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "DeepseekV3ForCausalLM": KEEP_DEFAULT,  # deepseek-ai/DeepSeek-V3
        "KimiK2ForCausalLM": KEEP_DEFAULT,  # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, FP8 (maxtext Run_Kimi.md)
        "MiniMaxM2ForCausalLM": KEEP_DEFAULT,  # MiniMaxAI/MiniMax-M2
        "GlmMoeDsaForCausalLM": KEEP_DEFAULT + DSA_INDEXER_WEIGHTS,  # zai-org/GLM-5.x FP8
        "Qwen3NextForCausalLM": KEEP_DEFAULT
        + GATED_DELTA_NET_SMALL_PROJECTIONS,  # Qwen/Qwen3.6-35B-A3B-FP8 (same GDN layers)
        "Qwen3_5ForCausalLM": KEEP_DEFAULT + GATED_DELTA_NET_SMALL_PROJECTIONS,
        "Qwen3_5MoeForCausalLM": KEEP_DEFAULT + GATED_DELTA_NET_SMALL_PROJECTIONS,
        "Qwen3_5ForConditionalGeneration": KEEP_DEFAULT + GATED_DELTA_NET_SMALL_PROJECTIONS,
        "Qwen3_5MoeForConditionalGeneration": KEEP_DEFAULT + GATED_DELTA_NET_SMALL_PROJECTIONS,
    }
)


def keep_patterns_for(architecture: str | None) -> tuple[str, ...]:
    """The keep patterns of ``architecture`` (an HF ``architectures[0]``): its row, else ``KEEP_DEFAULT``."""
    return KEEP_BY_ARCHITECTURE.get(architecture or "", KEEP_DEFAULT)
