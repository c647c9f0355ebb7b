"""The conformance check: RefitBridge's export of a registered architecture against stock's.

Owns what one cell of the conformance matrix (architecture x layout x BF16/FP8) means and how it
is decided. For an architecture (``testing.tiny_models``) and a layout, every rank builds the
Megatron model (``models.builder``; CPU: gloo, local modules), fills it with seeded random
values, and compares (``testing.export_comparison``)

* BF16: ``RefitBridge.export_hf_weights`` with stock ``export_hf_weights_stock`` on the same model:
  the same names in the same order, each tensor with the same dtype, shape and bytes;
* FP8 (``fp8="blockwise"``): the FP8 export with the stream expected from stock's tensors: every
  tensor the format quantizes (``BlockwiseFP8Config.quantizes``) replaced by the reference
  quantizer's data (``fp8.reference.quantize_reference``) followed by its scales.
* LoRA (``--lora``, at ``LORA_LAYOUTS``; ``check_lora``): then the same model wrapped with
  Megatron-Bridge's ``LoRA`` (default target modules), adapters random: the merged export with
  stock's merged export, the adapter export with stock's adapter export, as BF16 compares.

On CPU the build is a weights-only build (``models.builder``: the concessions it takes are
recorded in the cell); where
stock's export fails because the bridge maps no conversion task to some parameters of the build
(a family whose CPU build has sequential experts, ``local_experts.N``, and whose mapping has
grouped ones only), the reason names them.

The oracle is stock (and the reference quantizer on stock's tensors), never our own output. Each
cell ends in one ``CellState``; ``DIFFERENT`` and ``OUR_EXPORT_FAILED`` are failures (bugs of ours
until shown otherwise), the others are outcomes with their reason recorded.

Run as ranks (what ``tests/test_conformance.py`` and ``scripts/conformance_matrix.py`` do)::

    python -m mbridge_refit.testing.conformance --json cells.json [--only A,B]            # TP1
    torchrun --nproc-per-node 2 -m mbridge_refit.testing.conformance --layout tp2 --json cells.json
    torchrun --nproc-per-node 2 -m mbridge_refit.testing.conformance --layout tp2,pp2,ep2,tp2ep2 \
        --only pp2:Qwen3ForCausalLM,ep2:Qwen3MoeForCausalLM --json cells.json
    python -m mbridge_refit.testing.conformance --json cells.json --lora all      # TP1 with the LoRA cells

``--nproc-per-node`` is the layouts' ``expected_world_size`` (2 for every layout but TP1). Several
layouts of one world size run in one launch, one after the other (Megatron's groups are made
again for each): the ranks start once, which is most of a small layout's time on CPU.

Each rank writes its cells to ``cells.rank<R>.json`` beside the path given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import enum
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch

from mbridge_refit.fp8.format import FP8FormatError
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.testing.export_comparison import compare_stream, fp8_expected
from mbridge_refit.testing.tiny_models import MOE_BLOCK, PACKED_EXPERTS

__all__ = [
    "add_selection_arguments",
    "selection",
    "BF16",
    "Cell",
    "CellState",
    "EXPERT_PARALLEL_MODELS",
    "FP8",
    "GROUPED_EXPERT_FAMILIES",
    "LORA_ADAPTER",
    "LORA_LAYOUTS",
    "LORA_MERGED",
    "LORA_PRECISIONS",
    "HYBRID_MOE_FAMILIES",
    "MATRIX_LAYOUTS",
    "MATRIX_VARIANTS",
    "MOE_BLOCK_MODELS",
    "PACKED_EXPERT_MODELS",
    "PRECISIONS",
    "RANDOM_STD",
    "SESSION_TIMEOUT",
    "architectures_at",
    "check_architecture",
    "check_bf16",
    "check_fp8",
    "check_lora",
    "describe_error",
    "fill_random_weights",
    "main",
    "random_megatron_model",
    "rank_result_path",
    "read_cells",
    "restored_environment",
    "run_layout",
    "selected_cells",
]

logger = logging.getLogger(__name__)

BF16, FP8 = "bf16", "fp8"
PRECISIONS = (BF16, FP8)
# The LoRA columns: the model wrapped with Megatron-Bridge's ``LoRA`` (its default targets), the merged
# export against stock's merged export, the adapter export against stock's adapter export.
LORA_MERGED, LORA_ADAPTER = "lora-merged", "lora-adapter"
LORA_PRECISIONS = (LORA_MERGED, LORA_ADAPTER)
LORA_LAYOUTS = ("tp1",)  # the layouts whose launch adds the LoRA cells (tests/test_lora.py covers TP2, PP2, EP2)
LORA_DIM, LORA_ALPHA = 4, 8  # r and alpha of the wrap (scale 2: every adapted weight moves visibly in bf16)
RANDOM_STD = 0.02  # random weights ~ N(0, 0.02), seeded per parameter and shard
SESSION_TIMEOUT = datetime.timedelta(minutes=2)  # a rank whose peer failed raises instead of hanging

# The matrix: layout name -> the layout and which architectures run at it (None: every registered
# one). Beyond TP1 the matrix runs the families that build on CPU (tiny configs: 2 or 4 layers,
# 8 experts), chosen to cover the placement kinds each layout splits:
# * TP2: QKV with and without bias and QK norms, per-layer head layouts (Gemma 4), gated and plain
#   MLPs, MoE experts (with an expert bias and a dense first layer in HY-V3; stacked experts in
#   GPT-OSS; grouped experts, TE's ``weightN``, in the decoder-block-spec families), multi-latent
#   attention (DeepSeek-V2/V3, GLM-4.7-Flash: down projections duplicated over TP, norms fused into
#   the up projections), vision-language models (Qwen3.5-VL's and Qwen3-VL's concatenated vision
#   QKV), tied embeddings, a hybrid Mamba model (Nemotron-H: the mixer's in_proj and conv1d split
#   per component, two Mamba groups), relaid tensors (Gemma 3 VL's transposed projector, ERNIE
#   4.5's expert bias given a leading dimension), and a model the plan refuses (EXAONE 4.5's vision
#   QKV: its stock fallback and FP8 refusal at TP2). Gemma 3 adds Transformer Engine's module
#   structure (built from its stand-ins, models.cpu_specs): norms fused into the column-parallel
#   linears (``layer_norm_weight``) and replicated norms inside the row-parallel ones
#   (``post_layernorm``); Qwen3-VL a vision tower with deepstack mergers built inside its provider.
# * PP2: the same families but Gemma 4 (its provider supports PP=1 only): stages split the layers,
#   the embedding and the head (tied in Gemma: the head is the first stage's embedding), the
#   vision towers (first stage only: Qwen2.5-VL's, and Qwen3-VL's whose deepstack features feed the
#   first stage's layers) and dense and MoE layers (HY-V3's and DeepSeek's stages differ in kind;
#   Nemotron-H's hold Mamba and MoE, then attention and MLP layers; Qwen3-Next's and Qwen3.5's
#   gated-delta-net and attention layers; Gemma 3 VL's tied head on the last stage of a VLM).
# * EP2 and TP2xEP2 (2 ranks: the experts split across the tensor-parallel ranks, Megatron's
#   expert tensor parallel size 1): every MoE family whose CPU build stock can export: Qwen3-MoE
#   (per-expert tensors), HY-V3 and ERNIE 4.5 (expert bias, dense first layer), GPT-OSS (stacked experts,
#   gathered over EP), the hybrid MoE families (Nemotron-H, Qwen3-Next, Qwen3.5-MoE: experts beside
#   Mamba or gated-delta-net layers) and the grouped-expert families (DeepSeek, GLM-4.5, MiniMax-M3),
#   and the packed-expert checkpoint variants (one [E, ...] tensor per projection, stacked over EP;
#   Qwen3-VL-MoE's published one transposed; at PP2 too, their stacks on either stage) and Gemma 4's
#   MoE model (a MoE block beside each dense MLP; at TP2 and PP2 too). The other
#   MoE families are stock's (ERNIE 4.5 VL's stateful expert-bias mapping) or fail at TP1 already:
#   the TP1 column records why.
# TP1 runs every registered architecture and the checkpoint variants (``MATRIX_VARIANTS``).
# Cells that repeat a placement kind a faster default cell of the same layout proves are marked
# slow in ``tests/conftest.py::SLOW_CASES`` (the matrix page shows them all).
HYBRID_MOE_FAMILIES = (
    "NemotronHForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
)  # MoE beside Mamba / gated delta nets
GROUPED_EXPERT_FAMILIES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Glm4vMoeForConditionalGeneration",
    "MiniMaxM3SparseForConditionalGeneration",
)
# The families whose bridge reads routed experts packed ([E, ...] per projection) when the checkpoint
# holds them so, as checkpoint variants (``testing.tiny_models.CHECKPOINT_VARIANTS``): their bridge is built
# from the tiny checkpoint, as users build it, and maps the experts with its packed-expert mappings.
PACKED_EXPERT_MODELS = tuple(
    f"{architecture}+{PACKED_EXPERTS}"
    for architecture in (
        "Glm4MoeForCausalLM",
        "Glm4vMoeForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    )
)
# Gemma 4's MoE model: the same model class as the dense one, another provider and layer spec.
MOE_BLOCK_MODELS = (f"Gemma4ForCausalLM+{MOE_BLOCK}",)
MATRIX_VARIANTS = (
    *PACKED_EXPERT_MODELS,
    *MOE_BLOCK_MODELS,
)  # the variant models every layout of None (TP1) runs beside the registered architectures
EXPERT_PARALLEL_MODELS = (  # the models EP2 and TP2xEP2 run
    "Ernie4_5_MoeForCausalLM",
    "GptOssForCausalLM",
    "HYV3ForCausalLM",
    "Qwen3MoeForCausalLM",
    *HYBRID_MOE_FAMILIES,
    *GROUPED_EXPERT_FAMILIES,
    *PACKED_EXPERT_MODELS,
    *MOE_BLOCK_MODELS,
)
SPLIT_LAYOUT_FAMILIES = (  # the registered architectures both the TP2 and the PP2 column run
    "Ernie4_5_MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "GemmaForCausalLM",
    "GptOssForCausalLM",
    "HYV3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "NemotronForCausalLM",
    "NemotronHForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
TP2_ONLY_FAMILIES = (  # the TP2 column runs these too; the PP2 column does not
    "Exaone4_5_ForConditionalGeneration",
    "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
)
MATRIX_LAYOUTS: Mapping[str, tuple[ParallelLayout, tuple[str, ...] | None]] = MappingProxyType(
    {
        "tp1": (ParallelLayout(), None),
        "tp2": (
            ParallelLayout(tp=2),
            (*sorted((*SPLIT_LAYOUT_FAMILIES, *TP2_ONLY_FAMILIES)), *GROUPED_EXPERT_FAMILIES, *MOE_BLOCK_MODELS),
        ),
        "pp2": (
            ParallelLayout(pp=2),
            (*SPLIT_LAYOUT_FAMILIES, *GROUPED_EXPERT_FAMILIES, *PACKED_EXPERT_MODELS, *MOE_BLOCK_MODELS),
        ),
        "ep2": (ParallelLayout(ep=2), EXPERT_PARALLEL_MODELS),
        "tp2ep2": (ParallelLayout(tp=2, ep=2), EXPERT_PARALLEL_MODELS),
        # Megatron-Core's own default for a MoE model at TP2 (expert-TP = TP): each routed expert split in two
        "tp2etp2": (ParallelLayout(tp=2, etp=2), EXPERT_PARALLEL_MODELS),
    }
)


class CellState(enum.StrEnum):
    """How one cell ended."""

    FAST_PATH_EXACT = "fast path, exact"
    STOCK_FALLBACK_EXACT = "stock fallback, exact"  # the plan refused the model; the fallback is stock itself
    FP8_REFUSED = "FP8 refused"  # FP8FormatError before any export work (e.g. a model without a plan)
    CANNOT_BE_BUILT = "cannot be built here"  # config, bridge or model construction failed
    UPSTREAM_BROKEN = (
        "upstream broken"  # stock's own export failed (roundtrip: the bridge maps no task to some parameters)
    )
    LORA_CANNOT_WRAP = "LoRA cannot wrap"  # LoRA columns: Megatron-Bridge's LoRA raised on the build or wrapped nothing
    EXACT = "exact"  # roundtrip column: every tensor back bit for bit
    REFUSED = "refused"  # roundtrip column: convert exited with an input error naming why
    DIFFERENT = "different"  # a name, order, dtype, shape or byte differs from the oracle
    OUR_EXPORT_FAILED = "our export failed"

    @property
    def passes(self) -> bool:
        return self not in (CellState.DIFFERENT, CellState.OUR_EXPORT_FAILED)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    """The outcome of one architecture at one layout and precision."""

    architecture: str
    layout: str
    precision: str  # BF16 | FP8 | LORA_MERGED | LORA_ADAPTER
    state: CellState
    detail: str = ""  # the error, fallback reason or first differences; empty when exact on the fast path
    tensors: int = 0  # tensors compared
    concessions: tuple[str, ...] = ()  # models.builder.CPU_WEIGHT_ONLY_CONCESSIONS fields the build set

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "state": str(self.state)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Cell":
        return cls(**{**data, "state": CellState(data["state"]), "concessions": tuple(data["concessions"])})


# --- Building a model with random weights. -------------------------------------------------------


def fill_random_weights(
    chunks: Sequence[torch.nn.Module], *, seed: int = 0, only: Callable[[str], bool] | None = None
) -> None:
    """Fill every parameter (those whose name ``only`` accepts, if given) with N(0, ``RANDOM_STD``)
    values seeded by its name and shard.

    Shards of one tensor differ (the seed takes the tensor/expert-parallel rank of split
    parameters) and replicas agree (a tensor-parallel replicated norm gets the same values on
    every tensor-parallel rank, as in a real model).
    """
    from megatron.core import parallel_state as ps

    pipeline_rank = ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for chunk_index, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters():
                if only is not None and not only(name):
                    continue
                shard = (
                    ps.get_tensor_model_parallel_rank() if getattr(param, "tensor_model_parallel", False) else 0,
                    ps.get_expert_model_parallel_rank() if not getattr(param, "allreduce", True) else 0,
                )
                generator = torch.Generator().manual_seed(_seed(seed, name, pipeline_rank, chunk_index, *shard))
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * RANDOM_STD
                param.copy_(values.to(param.dtype))


def _seed(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_megatron_model(
    model: str, layout: ParallelLayout, *, device: torch.device, work_dir: Path | None = None
) -> tuple[Any, list[torch.nn.Module], tuple[str, ...]]:
    """``(RefitBridge, model chunks, concessions)`` of ``model``'s tiny config at ``layout``, in
    bf16 with random weights, built for weights only (on CPU: with the concessions whose fields are
    returned; call inside a distributed session at ``layout``). An architecture's bridge is built
    from its config; a checkpoint variant's (``architecture+variant``) from its tiny checkpoint,
    written under ``work_dir`` (which must outlive the bridge: stock reads it while exporting)."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.builder import (
        BuildOptions,
        build_model,
        cpu_concessions,
    )
    from mbridge_refit.testing.tiny_models import (
        split_variant,
        tiny_config,
        write_tiny_checkpoint,
    )

    if split_variant(model)[1] is None:
        bridge = RefitBridge.from_hf_config(tiny_config(model))
    elif work_dir is None:
        raise ValueError(f"{model}: a checkpoint variant's bridge is built from a checkpoint: pass work_dir")
    else:
        bridge = RefitBridge.from_hf_pretrained(write_tiny_checkpoint(model, work_dir / "checkpoint"))
    concessions = cpu_concessions(bridge.to_megatron_provider(load_weights=False)) if device.type == "cpu" else {}
    chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16, weights_only=True))
    fill_random_weights(chunks)
    return bridge, chunks, tuple(concessions)


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """``os.environ`` as it was, after the block: Megatron's model build sets Transformer Engine's
    attention-backend variables and asserts them on the next build, so one architecture's build
    would decide whether the next one builds."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --- Deciding the cells. -------------------------------------------------------------------------


def check_architecture(architecture: str, layout_name: str, *, device: torch.device, lora: bool = False) -> list[Cell]:
    """The BF16 and FP8 cells of ``architecture`` at ``MATRIX_LAYOUTS[layout_name]``, then (``lora``)
    its LoRA cells (``check_lora``, on the same model once those are decided)."""
    with tempfile.TemporaryDirectory(prefix="conformance-") as work_dir:
        return _check_architecture(architecture, layout_name, device=device, work_dir=Path(work_dir), lora=lora)


def _check_architecture(
    architecture: str, layout_name: str, *, device: torch.device, work_dir: Path, lora: bool
) -> list[Cell]:
    layout = MATRIX_LAYOUTS[layout_name][0]
    precisions = (*PRECISIONS, *(LORA_PRECISIONS if lora else ()))
    cell = _cell_maker(architecture, layout_name, ())
    try:
        with restored_environment():
            bridge, chunks, concessions = random_megatron_model(architecture, layout, device=device, work_dir=work_dir)
    except Exception as err:  # recorded; the matrix goes on with the next architecture
        return [cell(precision=p, state=CellState.CANNOT_BE_BUILT, detail=describe_error(err)) for p in precisions]
    cell = _cell_maker(architecture, layout_name, concessions)
    try:
        stock = [(name, tensor.clone()) for name, tensor in bridge.export_hf_weights_stock(chunks, show_progress=False)]
    except Exception as err:
        reason = describe_error(err) + _unmapped_note(bridge, chunks)
        return [cell(precision=p, state=CellState.UPSTREAM_BROKEN, detail=reason) for p in precisions]
    cells = [check_bf16(bridge, chunks, stock, cell), check_fp8(bridge, chunks, stock, cell)]
    if lora:
        start = time.perf_counter()
        cells += check_lora(bridge, chunks, stock, cell)
        logger.info("%s %s: LoRA cells in %.1f s", architecture, layout_name, time.perf_counter() - start)
    return cells


def _unmapped_note(bridge: Any, chunks: list[torch.nn.Module], limit: int = 2) -> str:
    """``"; the bridge maps no parameter X, ..."`` when its conversion tasks leave parameters of
    this model out (stock's export then fails on the missing task), else ``""``."""
    try:
        tasks = bridge.megatron_model_bridge(chunks).build_conversion_tasks(bridge.hf_pretrained, chunks)
    except Exception as err:  # the note is a diagnosis only
        logger.debug("no conversion tasks to diagnose with: %s", err)
        return ""
    mapped = {task.param_name for task in tasks if task is not None}
    unmapped = [name for chunk in chunks for name, _ in chunk.named_parameters() if name not in mapped]
    if not unmapped:
        return ""
    return f"; the bridge maps no task to {len(unmapped)} parameters of this build, e.g. {', '.join(unmapped[:limit])}"


def _cell_maker(architecture: str, layout_name: str, concessions: tuple[str, ...]) -> Callable[..., Cell]:
    """``Cell`` of this architecture, layout and concessions: the caller names the rest."""
    return functools.partial(Cell, architecture=architecture, layout=layout_name, concessions=concessions)


def check_bf16(
    bridge: Any,
    chunks: list[torch.nn.Module],
    stock: list[tuple[str, torch.Tensor]],
    cell: Callable[..., Cell],
    *,
    precision: str = BF16,
) -> Cell:
    """Our BF16 export (cached buffers, as refit runs it) against stock's tensors, as the cell of
    ``precision`` (``LORA_MERGED``: the same call on a wrapped model, whose adapters it merges)."""
    return _check_stream(bridge, precision, stock, bridge.export_hf_weights, chunks, cell)


def _check_stream(
    bridge: Any,
    precision: str,
    expected: list[tuple[str, torch.Tensor]],
    export: Callable[..., Any],
    chunks: list[torch.nn.Module],
    cell: Callable[..., Cell],
) -> Cell:
    """The cell of our export ``export`` (a bridge method, run with cached buffers as refit runs it)
    against ``expected``: ``different``, ``our export failed``, or exact on the fast path or on the
    stock fallback (with the reason the bridge gives)."""
    try:
        comparison = compare_stream(expected, export(chunks, show_progress=False, reuse_buffer_from_cache=True))
    except Exception as err:
        return cell(precision=precision, state=CellState.OUR_EXPORT_FAILED, detail=describe_error(err))
    if not comparison.exact:
        return cell(
            precision=precision, state=CellState.DIFFERENT, detail=comparison.describe(), tensors=comparison.compared
        )
    fallback = bridge.export_diagnostics().fallback_reason
    if fallback:
        return cell(
            precision=precision, state=CellState.STOCK_FALLBACK_EXACT, detail=fallback, tensors=comparison.compared
        )
    return cell(precision=precision, state=CellState.FAST_PATH_EXACT, detail="", tensors=comparison.compared)


def check_fp8(
    bridge: Any, chunks: list[torch.nn.Module], stock: list[tuple[str, torch.Tensor]], cell: Callable[..., Cell]
) -> Cell:
    """Our blockwise FP8 export against the reference quantizer applied to stock's tensors, with
    the keep patterns of the model's family (the config ``fp8="blockwise"`` exports with)."""
    try:
        config = bridge.fp8_config("blockwise")
        stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8=config)
    except FP8FormatError as err:  # refused before any export work, with the reason
        return cell(precision=FP8, state=CellState.FP8_REFUSED, detail=describe_error(err))
    except Exception as err:
        return cell(precision=FP8, state=CellState.OUR_EXPORT_FAILED, detail=describe_error(err))
    try:
        comparison = compare_stream(fp8_expected(stock, config), stream)
    except Exception as err:
        return cell(precision=FP8, state=CellState.OUR_EXPORT_FAILED, detail=describe_error(err))
    if not comparison.exact:
        return cell(precision=FP8, state=CellState.DIFFERENT, detail=comparison.describe(), tensors=comparison.compared)
    return cell(precision=FP8, state=CellState.FAST_PATH_EXACT, detail="", tensors=comparison.compared)


def check_lora(
    bridge: Any,
    chunks: list[torch.nn.Module],
    unadapted: list[tuple[str, torch.Tensor]],
    cell: Callable[..., Cell],
) -> list[Cell]:
    """The LoRA cells: ``chunks`` wrapped with Megatron-Bridge's ``LoRA`` (its default target
    modules, r ``LORA_DIM``, alpha ``LORA_ALPHA``; wrapped in place, so call last), every adapter
    parameter random (B too, which LoRA zero-initialises: a merge that dropped the adapters would
    otherwise pass), then

    * ``LORA_MERGED``: ``export_hf_weights`` (stock's default ``merge_adapter_weights=True``) against
      stock's merged export of the same model;
    * ``LORA_ADAPTER``: ``export_adapter_weights`` against stock's adapter export (``upstream
      broken`` where stock's yields a name twice: GPT-OSS's stacked experts, one factor per expert
      under one name).

    Both oracles run on a model bridge made as stock's ``AutoBridge`` makes one per call
    (``_stock_model_bridge``), not on the one ``bridge`` keeps.

    ``unadapted`` is stock's export before the wrap: stock's merged export must differ from it in
    some tensor, else the merged cell could not tell a merge from none (``upstream broken``, named).
    ``LoRA cannot wrap``: the wrap raised, or none of the target modules is in the build."""
    from megatron.bridge.peft.lora import LoRA

    def both(state: CellState, detail: str) -> list[Cell]:
        return [cell(precision=p, state=state, detail=detail) for p in LORA_PRECISIONS]

    lora = LoRA(dim=LORA_DIM, alpha=LORA_ALPHA)
    try:
        chunks = lora(chunks, training=True)
    except Exception as err:
        return both(CellState.LORA_CANNOT_WRAP, describe_error(err))
    if not any(_is_adapter(name) for chunk in chunks for name, _ in chunk.named_parameters()):
        return both(CellState.LORA_CANNOT_WRAP, f"no module of this build is one of {', '.join(lora.target_modules)}")
    fill_random_weights(chunks, seed=1, only=_is_adapter)
    bridge.forget_model()  # its plan describes the model before the wrap
    return [_check_merged(bridge, chunks, unadapted, cell), _check_adapter(bridge, chunks, cell)]


def _check_merged(
    bridge: Any, chunks: list[torch.nn.Module], unadapted: list[tuple[str, torch.Tensor]], cell: Callable[..., Cell]
) -> Cell:
    """``LORA_MERGED`` of a wrapped model (``check_lora``)."""
    try:
        stock = [
            (name, tensor.clone())
            for name, tensor in _stock_model_bridge(bridge).stream_weights_megatron_to_hf(
                chunks, bridge.hf_pretrained, cpu=False, show_progress=False, merge_adapter_weights=True
            )
        ]
    except Exception as err:
        return cell(
            precision=LORA_MERGED,
            state=CellState.UPSTREAM_BROKEN,
            detail=f"stock's merged export failed: {describe_error(err)}",
        )
    before = dict(unadapted)
    if all(name in before and torch.equal(tensor, before[name]) for name, tensor in stock):
        return cell(
            precision=LORA_MERGED,
            state=CellState.UPSTREAM_BROKEN,
            detail="stock's merged export equals the export before the wrap",
        )
    return check_bf16(bridge, chunks, stock, cell, precision=LORA_MERGED)


def _check_adapter(bridge: Any, chunks: list[torch.nn.Module], cell: Callable[..., Cell]) -> Cell:
    """``LORA_ADAPTER`` of a wrapped model (``check_lora``)."""
    try:
        stock = [
            (t.param_name, t.weight.clone())
            for t in _stock_model_bridge(bridge).stream_adapter_weights_megatron_to_hf(
                chunks, cpu=False, show_progress=False
            )
        ]
    except Exception as err:
        return cell(
            precision=LORA_ADAPTER,
            state=CellState.UPSTREAM_BROKEN,
            detail=f"stock's adapter export failed: {describe_error(err)}",
        )
    if not stock:
        return cell(
            precision=LORA_ADAPTER, state=CellState.UPSTREAM_BROKEN, detail="stock's adapter export yields no tensor"
        )
    names = [name for name, _ in stock]
    if len(set(names)) < len(names):  # no PEFT checkpoint can hold it; a comparison by name would be meaningless
        repeated = sorted({name for name in names if names.count(name) > 1})
        return cell(
            precision=LORA_ADAPTER,
            state=CellState.UPSTREAM_BROKEN,
            detail=f"stock's adapter export yields {len(names)} tensors under {len(set(names))} names, "
            f"e.g. {repeated[0]} {names.count(repeated[0])} times",
        )
    return _check_stream(bridge, LORA_ADAPTER, stock, bridge.export_adapter_weights, chunks, cell)


def _stock_model_bridge(bridge: Any) -> Any:
    """A Megatron-Bridge model bridge made as stock's ``AutoBridge`` makes one for each export call
    (``AutoBridge._model_bridge``): the LoRA oracle is what a stock user gets, whatever state the
    model bridge ``bridge`` keeps for the model holds."""
    from megatron.bridge import AutoBridge

    return AutoBridge._model_bridge.fget(bridge)


def _is_adapter(name: str) -> bool:
    """Whether a parameter is a LoRA factor (``...linear_qkv.adapter.linear_in.weight``)."""
    return ".adapter." in name


def describe_error(err: BaseException, limit: int = 300) -> str:
    """``Type: message (at file:line)``: the message on one line cut to ``limit`` characters, the
    file of the innermost frame from its package down (the same on every machine)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {_package_path(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message[:limit]}{where}"


def _package_path(filename: str) -> str:
    path = filename.split("site-packages/")[-1]
    own = path.rfind("/mbridge_refit/")
    return path[own + 1 :] if own >= 0 else path


def architectures_at(layout_name: str) -> list[str]:
    """The architectures the matrix runs at ``layout_name``."""
    from mbridge_refit.testing.tiny_models import registered_architectures

    selected = MATRIX_LAYOUTS[layout_name][1]
    return list(selected) if selected is not None else [*registered_architectures(), *MATRIX_VARIANTS]


def run_layout(
    layout_name: str, architectures: Sequence[str], *, device: torch.device, lora: Collection[str] = ()
) -> Iterator[Cell]:
    """Every cell of ``architectures`` at ``layout_name``, the LoRA cells too for those in ``lora``
    (call inside a distributed session at that layout)."""
    for architecture in architectures:
        cells = check_architecture(architecture, layout_name, device=device, lora=architecture in lora)
        for cell in cells:
            logger.info("%s %s %s: %s %s", architecture, layout_name, cell.precision, cell.state, cell.detail[:200])
        yield from cells


# --- Running as ranks. ---------------------------------------------------------------------------


def rank_result_path(json_path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its cells for ``--json json_path``."""
    return json_path.with_name(f"{json_path.stem}.rank{rank}{json_path.suffix}")


def read_cells(json_path: Path, world_size: int) -> list[list[Cell]]:
    """Every rank's cells of one run, rank by rank."""
    return [
        [Cell.from_json(c) for c in json.loads(rank_result_path(json_path, rank).read_text())]
        for rank in range(world_size)
    ]


def selected_cells(layout_names: Sequence[str], only: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """``(layout, architectures)`` to run, layout by layout: each layout's own (``architectures_at``),
    or the entries of ``only``: ``ARCH`` runs at every layout, ``LAYOUT:ARCH`` at that one only."""
    unknown = sorted({e.partition(":")[0] for e in only if ":" in e} - set(layout_names))
    if unknown:
        raise ValueError(f"--only names layouts this run does not launch: {unknown} (launched: {list(layout_names)})")
    if not only:
        return [(name, architectures_at(name)) for name in layout_names]
    return [
        (name, [e.partition(":")[2] or e for e in only if ":" not in e or e.partition(":")[0] == name])
        for name in layout_names
    ]


def add_selection_arguments(parser: argparse.ArgumentParser, *, layouts_run: str) -> None:
    """``--layout`` and ``--only``, the cells a conformance launch runs (``selection``)."""
    parser.add_argument(
        "--layout",
        default="tp1",
        help=f"comma-separated layouts of MATRIX_LAYOUTS ({', '.join(MATRIX_LAYOUTS)}){layouts_run} (default tp1)",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated ARCH (at every layout) or LAYOUT:ARCH (default: each layout's)"
    )


def selection(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The layouts named by ``--layout`` and the cells to run (``selected_cells``); a wrong name
    ends the command through ``parser.error``."""
    layout_names = [name for name in args.layout.split(",") if name]
    unknown = [name for name in layout_names if name not in MATRIX_LAYOUTS]
    if unknown or not layout_names:
        parser.error(f"--layout {args.layout!r}: choose from {', '.join(MATRIX_LAYOUTS)}")
    try:
        return layout_names, selected_cells(layout_names, [e for e in args.only.split(",") if e])
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    add_selection_arguments(parser, layouts_run=" with one world size, run one after the other in this launch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, required=True, help="cells go to <stem>.rank<R>.json beside it")
    parser.add_argument(
        "--lora",
        default="",
        help="comma-separated ARCH whose LoRA cells run at the layouts of LORA_LAYOUTS, or 'all' (default: none)",
    )
    args = parser.parse_args(argv)
    layout_names, plan = selection(parser, args)
    lora = {e for e in args.lora.split(",") if e}
    world_sizes = {MATRIX_LAYOUTS[name][0].expected_world_size for name in layout_names}
    if len(world_sizes) != 1:
        parser.error(
            f"--layout {args.layout!r}: one launch runs layouts of one world size, these need {sorted(world_sizes)} ranks"
        )
    from mbridge_refit.convert.session import (
        LaunchEnv,
        distributed_session,
        init_model_parallel,
    )

    logging.basicConfig(
        level=logging.INFO if LaunchEnv.from_environ().rank == 0 else logging.WARNING, format="%(message)s"
    )
    logging.getLogger("mbridge_refit.bridge").setLevel(logging.ERROR)  # the fallback warning is recorded in the cell
    logging.getLogger("megatron.bridge.peft").setLevel(logging.WARNING)  # LoRA logs every module it wraps

    device = torch.device(args.device)
    cells = []
    with distributed_session(MATRIX_LAYOUTS[layout_names[0]][0], device=device, timeout=SESSION_TIMEOUT) as env:
        for layout_name, architectures in plan:
            init_model_parallel(MATRIX_LAYOUTS[layout_name][0])  # Megatron's groups of this layout, the ranks kept
            with_lora = () if layout_name not in LORA_LAYOUTS else architectures if "all" in lora else lora
            cells += [cell.to_json() for cell in run_layout(layout_name, architectures, device=device, lora=with_lora)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rank_result_path(args.json, env.rank).write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
