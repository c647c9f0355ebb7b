"""Shared test helpers: launching ranks under torchrun on CPU (gloo) and tiny source checkpoints."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

REPO = Path(__file__).resolve().parents[1]
LOWEST_PORT = 20000  # below the kernel's ephemeral range (Linux: 32768-60999 by default)


def free_port() -> int:
    """A TCP port nothing listens on, for a store a test binds next. Taken below the kernel's ephemeral
    range where it has room there: the port is free only until the test binds it, and a port from the
    ephemeral range can be handed in between to any connection of this host (a gloo pair of another
    test, a subprocess's), which failed a test with ``EADDRINUSE``; a port below it goes only to a
    process that asks for it by number. Elsewhere (a narrow or unknown range) the kernel's own pick."""
    low = _ephemeral_low()
    if low - LOWEST_PORT >= 1000:
        for _ in range(64):
            port = random.randrange(LOWEST_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("", port))
                except OSError:
                    continue
            return port
    return get_free_port()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str


def torchrun(nproc: int, module_args: list[str], *, timeout: float = 600) -> Launch:
    """Run ``python -m <module_args>`` on ``nproc`` CPU ranks (torchrun, gloo, a free port).

    One process runs as plain ``python -m`` (no torchrun), the way a user runs a single rank.
    A first argument ending in ``.py`` runs that script instead of a module.
    """
    target = module_args if module_args[0].endswith(".py") else ["-m", *module_args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for _ in range(PORT_TRIES):
        if nproc == 1:
            cmd = [sys.executable, *target]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                *target,
            ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        launch = Launch(proc.returncode, proc.stdout + proc.stderr)
        if not lost_its_port(launch):
            break
    return launch


PORT_TRIES = 3


def run_interpreted(script: str, expected: str) -> str:
    """Run the kernel check ``tests/ranks/<script>`` in Triton's CPU interpreter (``TRITON_INTERPRET=1``;
    skipped without Triton): it must exit 0 and print ``expected``. Returns its output."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    path = REPO / "tests" / "ranks" / script
    run = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert expected in run.stdout, run.stdout
    return run.stdout


def lost_its_port(launch: Launch) -> bool:
    """``free_port`` closes its socket before torchrun binds the port, so another process on the
    host can take it in between (more likely while other work runs beside the suite): that
    failure, and only that one, is worth a launch on another port."""
    return launch.returncode != 0 and "address already in use" in launch.output.lower()


@dataclass(frozen=True)
class MarginalCalls:
    """Host calls a counting script measured at a smaller and a larger size, and their difference
    per tensor (``tests/ranks/*host_work_check.py``: counted, not timed)."""

    few: dict
    many: dict
    python_per_tensor: float
    c_per_tensor: float

    @property
    def added(self) -> int:
        return self.many["tensors"] - self.few["tensors"]


def loaded_model(hf_dir, layout, device):
    """A bridge from ``hf_dir`` and its Megatron model built at ``layout`` on this rank, loaded from the
    checkpoint (finite weights: a model built alone may hold any bits). Call inside a distributed session."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.builder import BuildOptions, build_model

    bridge = RefitBridge.from_hf_pretrained(hf_dir)
    chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
    bridge.load_hf_shards(chunks, hf_dir)
    return bridge, chunks


def marginal_calls(
    script: str, flag: str, sizes: tuple[int, int], result: Path, extra: tuple[str, ...] = ()
) -> MarginalCalls:
    """Run ``tests/ranks/<script> <flag> <small> <large> --result <result> <extra...>`` in a process of
    its own and read the counts of the two sizes."""
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "ranks" / script),
            flag,
            *map(str, sizes),
            "--result",
            str(result),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    few, many = (json.loads(result.read_text())[str(size)] for size in sizes)
    added = many["tensors"] - few["tensors"]
    return MarginalCalls(
        few=few,
        many=many,
        python_per_tensor=(many["python_calls"] - few["python_calls"]) / added,
        c_per_tensor=(many["c_calls"] - few["c_calls"]) / added,
    )


@pytest.fixture(scope="session")
def source_checkpoints(tmp_path_factory):
    """Tiny random HF checkpoints, one per recipe, sharded so the index is exercised."""
    from mbridge_refit.models import recipes

    root = tmp_path_factory.mktemp("sources")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = recipes.make_random_checkpoint(
                recipes.get_model_recipe(name), root / name, seed=1234, max_shard_bytes=64 * 1024
            )
        return made[name]

    return get


def block_scaled_checkpoint(base: str, extra: dict, out: Path, *, name: str, seed: int) -> Path:
    """A tiny random checkpoint of recipe ``base`` with the config fields ``extra`` (recipe ``name``),
    every 128x128 block of each 2-D tensor scaled by its own power of two, so that blocks' FP8 scales
    differ (a scale taken from another block is caught)."""
    import dataclasses

    import torch
    from safetensors.torch import load_file, save_file

    from mbridge_refit.models import recipes

    recipe = recipes.get_model_recipe(base)
    recipe = dataclasses.replace(recipe, name=name, hf_config={**recipe.hf_config, **extra})
    path = recipes.make_random_checkpoint(recipe, out, seed=seed)
    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        for key, tensor in tensors.items():
            if tensor.dim() == 2:
                rows = torch.arange(tensor.shape[0]).unsqueeze(1) // 128
                cols = torch.arange(tensor.shape[1]).unsqueeze(0) // 128
                tensors[key] = (tensor.float() * 2.0 ** ((rows + 2 * cols + len(key)) % 5)).to(tensor.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


# --- The slow marker: left out of a run unless asked for. -------------------------------------------


# Conformance cells of the grouped-expert families (MATRIX_LAYOUTS) that repeat at a layout what
# a default cell of that layout proves: by default DeepSeek-V3 runs at every 2-rank layout
# (multi-latent attention, grouped experts with an expert bias, a dense first layer), GLM-4.5 at
# TP2 and EP2 (grouped experts behind GQA attention), MiniMax-M3 at TP2 (its replicated
# indexers and vision tower) and GLM-4.5V at PP2 (the vision tower on the first stage).
# Likewise the hybrid families beyond TP2: by default Qwen3.5-MoE at PP2, EP2 and TP2xEP2 (gated
# delta nets, gated attention, experts) and Nemotron-H at PP2 and EP2 (Mamba mixers and experts).
HYBRID_REPEATS = (
    "pp2-Qwen3NextForCausalLM",
    "pp2-Qwen3_5ForCausalLM",
    "ep2-Qwen3NextForCausalLM",
    "tp2ep2-Qwen3NextForCausalLM",
    "tp2ep2-NemotronHForCausalLM",
)
GROUPED_EXPERT_REPEATS = (
    *(
        f"{layout}-{arch}"
        for layout in ("tp2", "pp2", "ep2", "tp2ep2")
        for arch in ("DeepseekV2ForCausalLM", "Glm4MoeLiteForCausalLM")
    ),
    "tp2-Glm4vMoeForConditionalGeneration",
    "ep2-Glm4vMoeForConditionalGeneration",
    "tp2ep2-Glm4vMoeForConditionalGeneration",
    "pp2-Glm4MoeForCausalLM",
    "tp2ep2-Glm4MoeForCausalLM",
    "pp2-MiniMaxM3SparseForConditionalGeneration",
    "ep2-MiniMaxM3SparseForConditionalGeneration",
    "tp2ep2-MiniMaxM3SparseForConditionalGeneration",
)
# The packed-expert checkpoint variants beyond TP1: by default Qwen3-VL-MoE (its published transposed
# stack) at PP2 and EP2, Qwen3.5-MoE at EP2, GLM-4.5 at TP2xEP2.
PACKED = "+packed_experts"
PACKED_REPEATS = (
    *(
        f"pp2-{arch}{PACKED}"
        for arch in (
            "Glm4MoeForCausalLM",
            "Glm4vMoeForConditionalGeneration",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration",
        )
    ),
    *(
        f"ep2-{arch}{PACKED}"
        for arch in ("Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
    ),
    *(
        f"tp2ep2-{arch}{PACKED}"
        for arch in (
            "Glm4vMoeForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration",
        )
    ),
)

# Gemma 4 MoE (a MoE block beside each dense MLP, its experts packed) by default at TP1, TP2 and EP2.
MOE_BLOCK_REPEATS = ("pp2-Gemma4ForCausalLM+moe_block", "tp2ep2-Gemma4ForCausalLM+moe_block")

# ERNIE 4.5 MoE (expert bias with a leading dimension, experts) by default at TP2 and TP2xEP2.
RELAID_REPEATS = ("pp2-Ernie4_5_MoeForCausalLM", "ep2-Ernie4_5_MoeForCausalLM")

# Megatron's default expert-TP (TP2xETP2) beyond the families that prove each kind of expert split:
# by default Qwen3-MoE (per-expert grouped linears), DeepSeek-V3 (shared experts, MLA beside them)
# and Qwen3-VL-MoE's packed experts (a transposed stack of joined shards).
ETP_REPEATS = tuple(
    f"tp2etp2-{arch}"
    for arch in (
        "Ernie4_5_MoeForCausalLM",
        "GptOssForCausalLM",
        "HYV3ForCausalLM",
        "NemotronHForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "Glm4vMoeForConditionalGeneration",
        "MiniMaxM3SparseForConditionalGeneration",
        *(
            f"{a}{PACKED}"
            for a in (
                "Glm4MoeForCausalLM",
                "Glm4vMoeForConditionalGeneration",
                "Qwen3_5MoeForCausalLM",
                "Qwen3_5MoeForConditionalGeneration",
            )
        ),
        "Gemma4ForCausalLM+moe_block",
    )
)

# Multi-rank cases marked slow here (28-46 s each on 2 cores in the full run at 68949ce): each repeats,
# at another layout or precision, what a faster case of the same test proves in the default run.
SLOW_CASES = frozenset(
    {
        # The full run at 99a8b22 (1514 passed, 51:21 on 2 cores) put these 35-45 s repeats on the default path;
        # the default run keeps each layout and check: LoRA at TP1, TP2 and EP2 (attention adapters), the TP2
        # engine fed from TP2 and TP1, the drop-in NeMo-RL tasks at TP1 and TP2, FP8 parameters at TP2 and EP2.
        "tests/test_lora.py::test_lora_refit_matches_stock[qwen3-tiny-pp2]",
        "tests/test_lora.py::test_lora_refit_matches_stock[qwen3-moe-tiny-ep2-expect-fallback]",
        "tests/test_sharded_engine_refit.py::test_sharded_refit_from_tp2_into_a_tp4_engine",
        # the FP8 sharded refit from trainer TP1: its shards quantized as from TP2 (fp8 dense-tp2, moe-tp2),
        # its moves between ranks as in BF16 (dense-tp1)
        "tests/test_sharded_engine_refit.py::test_fp8_sharded_refit_into_a_tp2_engine[dense-tp1]",
        "tests/test_dropin.py::test_stock_call[pp2-tied-nemo_rl_tasks]",
        "tests/test_fp8.py::test_fp8_parameters_export_their_own_data_and_scales[pp2]",
        "tests/test_replicas.py::test_replicas_write_their_shares_in_parallel[qwen3-moe-tp2_ep2-fp8]",
        *(
            f"tests/test_replicas.py::test_roundtrip_cli_with_replicas[{c}]"
            for c in ("dp2_pp2", "dp2_pp2_vpp2", "cp2_tp2", "dp2_tp2_ep2")
        ),
        *(
            f"tests/test_replicas.py::test_replicated_layout_exports_exactly[{c}]"
            for c in ("dp2_pp2", "dp2_pp2_vpp2", "cp2_tp2")
        ),
        *(
            f"tests/test_packed_broadcast.py::test_packed_broadcast_from_one_replica[{c}]"
            for c in ("dp2_pp2", "dp2_pp2_vpp2", "cp2_tp2", "dp2_tp2_ep2")
        ),
        *(
            f"tests/test_sharded_refit.py::test_every_engine_rank_gets_its_slices_of_the_checkpoint[{c}]"
            for c in ("tp1", "ep2", "tp2_pp2")
        ),
        "tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[llama-tied-tiny-tp2_pp2]",
        # PP2 alone: llama-tied-tiny-pp2 keeps pipeline stages in the default run, and the README's main
        # command (tests/test_docs.py) runs the same tiny Qwen3 through TP2 x PP2 and back
        "tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[qwen3-tiny-pp2]",
        # expert-TP 2: the default run keeps it in test_sharded_refit's tp2_ep2_etp2, test_packed_broadcast's
        # qwen3-moe-tp2_etp2 and test_trainer_truth's Megatron default expert-TP (loaded, exported exactly)
        *(
            f"tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[qwen3-moe-tiny-{c}]"
            for c in ("tp2_ep2_etp2", "tp2_pp2_etp2")
        ),
        *(
            f"tests/test_export.py::test_plan_and_cached_export[qwen3-moe-tiny-{c}]"
            for c in ("tp2_etp2", "tp2_pp2_etp2", "etp2")
        ),
        "tests/test_export.py::test_plan_and_cached_export[llama-tied-tiny-tp2_pp2]",
        "tests/test_megatron_checkpoint.py::test_import_export_across_layouts[tied-pp2-to-tp1]",
        "tests/test_fp8.py::test_fp8_parameters_export_their_own_data_and_scales[tp2_pp2]",
        "tests/test_fp8.py::test_roundtrip_fp8_matches_reference_quantizer[tp2_pp2]",
        # The full run at f705bc0 (954 passed, 59:50 on 2 cores) put these 25-57 s repeats on the default
        # path: each layout stays proven by another default case (TP2 and PP2 apart, TP2xPP2 by the
        # README's main command, EP2 by TP2xEP2, PP2 of the MoE recipe by Qwen3's).
        "tests/test_packed_broadcast.py::test_packed_broadcast_ranks[qwen3-tp2_pp2]",
        "tests/test_packed_broadcast.py::test_packed_broadcast_ranks[qwen3-pp2]",
        "tests/test_packed_broadcast.py::test_packed_broadcast_ranks[qwen3-moe-ep2]",
        *(
            f"tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[{c}]"
            for c in ("qwen3-tiny-tp2_pp2", "qwen3-moe-tiny-pp2_vpp2", "qwen3-moe-tiny-ep2")
        ),
        *(
            f"tests/test_export.py::test_plan_and_cached_export[{c}]"
            for c in (
                "qwen3-moe-tiny-tp2_pp2",
                "qwen3-tiny-tp2_pp2",
                "llama-tied-tiny-tp2",
                "qwen3-moe-tiny-tp2",
                "qwen3-moe-tiny-pp2",
                "qwen3-moe-tiny-pp2_vpp2",
                "qwen3-tiny-pp2",
            )
        ),
        "tests/test_sharded_refit.py::test_every_engine_rank_gets_its_slices_of_the_checkpoint[tp2]",
        "tests/test_sharded_refit.py::test_benchmark_runs_exactly_on_cpu",  # the benchmark script's CPU smoke run
        "tests/test_replicas.py::test_replicated_layout_exports_exactly[dp2_tp2]",
        "tests/test_replicas.py::test_replicas_write_their_shares_in_parallel[qwen3-tp2]",  # as test_export_from_megatron_with_replicas
        # The CI run at a1c3d53 took 2982 s with setup: two more 4-rank and TP2 repeats (27-44 s). The CLI
        # with replicas stays proven by test_export_from_megatron_with_replicas; a perturbed weight failing
        # the verifier by its TP1 case (the README's example), the verifier at TP2 by its passing cases.
        "tests/test_replicas.py::test_roundtrip_cli_with_replicas[dp2_tp2]",
        "tests/test_verify_refit.py::test_verifier_fails_loudly_on_a_perturbed_weight",
        "tests/test_plan.py::test_plan_cli_json_matches_the_checkpoint[dp2_tp2_ep2]",
        *(
            f"tests/test_conformance.py::{test}[{cell}]"
            for test in (
                "test_bf16_matches_stock",
                "test_fp8_matches_reference",
                "test_mamba_families_take_the_fast_path",
                "test_stacked_expert_families_take_the_fast_path",
                "test_family_rule_architectures_take_the_fast_path",
            )
            for cell in (
                *GROUPED_EXPERT_REPEATS,
                *HYBRID_REPEATS,
                *PACKED_REPEATS,
                *MOE_BLOCK_REPEATS,
                *RELAID_REPEATS,
                *ETP_REPEATS,
            )
        ),
        # ConcatenatedQKVMapping at TP2/TP4 is proved against stock by tests/test_placement_rules.py and
        # Qwen3.5-VL at TP1 by the matrix's TP1 column; its TP2 build adds ~50 s to the TP2 launch.
        *(
            f"tests/test_conformance.py::{t}[tp2-Qwen3_5ForConditionalGeneration]"
            for t in (
                "test_bf16_matches_stock",
                "test_fp8_matches_reference",
                "test_family_rule_architectures_take_the_fast_path",
            )
        ),
        # The full run at 53e1832 took 59:08 of pytest on 2 cores (1467 tests); these repeats took
        # 662 s of it (16-46 s each). Each one's layout or fault stays proven by the default case
        # named beside it.
        "tests/test_sharded_refit.py::test_every_engine_rank_gets_its_slices_of_the_checkpoint[tp2_ep2]",  # tp2_ep2_etp2
        *(
            f"tests/test_export.py::test_plan_and_cached_export[{c}]"  # moe tp2_ep2; test_layer_map[pp2-vpp2]
            for c in ("qwen3-moe-tiny-ep2", "llama-tied-tiny-pp2_vpp2", "qwen3-tiny-tp2", "qwen3-tiny-pp2_vpp2")
        ),
        "tests/test_export.py::test_layer_map[pp2]",  # pp2-vpp2 and uneven-pp2-2+1
        *(
            f"tests/test_packed_broadcast.py::test_packed_broadcast_ranks[{c}]"  # moe tp2_etp2 (TP2 trainers)
            for c in ("qwen3-tp2", "qwen3-moe-tp2_ep2")
        ),
        *(
            f"tests/test_fp8.py::test_roundtrip_fp8_matches_reference_quantizer[{c}]"  # pp2_vpp2; moe-tp2_ep2
            for c in ("pp2", "moe-ep2", "tp2")
        ),
        "tests/test_fp8.py::test_fp8_parameters_export_their_own_data_and_scales[moe-ep2]",  # moe-tp2_ep2
        # overwrite: the case the lock was built for
        "tests/test_concurrent_writers.py::test_roundtrips_started_together_write_one_source_and_the_others_exit_2[new-output]",
        "tests/test_engine_refit.py::test_broadcast_refit_into_engine_layout[qwen3-moe-tiny-ep2]",  # qwen3-tiny-tp2
        "tests/test_engine_refit.py::test_refit_into_engine_layout[qwen3-tiny-tp2]",  # qwen3-moe-tiny-tp2_ep2
        # moe-ep2-to-tp2; test_fp8's Megatron checkpoint saved at TP2, exported at PP2
        "tests/test_megatron_checkpoint.py::test_export_is_bitwise_exact_at_any_layout[pp2]",
        "tests/test_verify_refit.py::test_verifier_passes_after_refit[qwen3-tiny-2]",  # llama-tied-tiny-2
        *(
            f"tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[{c}]"
            for c in (
                "qwen3-tiny-tp2",  # the README's main command: the same tiny Qwen3 at TP2 x PP2
                "qwen3-moe-tiny-etp2",  # expert-TP 2: test_trainer_truth's Megatron default expert-TP
                "qwen3-moe-tiny-pp2",  # llama-tied-tiny-pp2 (PP2 of the MoE recipe by another recipe's)
                "llama-tied-tiny-pp2_vpp2",  # llama-tied-tiny-pp2; test_fp8's roundtrip at pp2_vpp2
                "qwen3-moe-tiny-tp2",  # test_fp8's roundtrip of the MoE recipe at moe-tp2_ep2
            )
        ),
        # layout errors: test_recipes' dense-model refusals, test_convert_cli's launcher at a world that
        # --tp 2 does not divide, test_concurrent_writers' and test_megatron_checkpoint's non-empty outputs
        *(
            f"tests/test_convert_cli.py::{t}"
            for t in (
                "test_ep_on_a_dense_model",
                "test_world_size_must_match_layout",
                "test_existing_output_without_overwrite",
            )
        ),
        *(
            f"tests/test_load_validation.py::test_mismatched_tensor_is_refused[{c}]"  # projection-smaller
            for c in ("projection-wider", "embedding-rows")
        ),
        # A CI run took 3887 s with setup before these (a full local default run: 3259 s of tests). Each of these
        # repeats a layout or check that the default case named beside it keeps: the rank checkers load the
        # checkpoint and compare every exported tensor with it, so a checker at a layout proves the load and
        # export that a CLI roundtrip at that layout proves; the CLI writes alike at every layout of one replica.
        *(
            f"tests/test_roundtrip.py::test_roundtrip_is_bitwise_exact[{c}]"
            for c in (
                # test_conformance's roundtrip cell tp1-Qwen3ForCausalLM (a recipe family: asserted exact)
                "qwen3-tiny-tp1",
                # test_fp8's roundtrip at pp2_vpp2 (the CLI at PP2 x VPP2: kept tensors bit for bit, the rest
                # the reference quantizer of the file's); test_export's layer map at pp2-vpp2 (BF16 export)
                "qwen3-tiny-pp2_vpp2",
                # the tied weight by llama-tied-tiny-pp2; TP2 by the README's TP2 x PP2; the tied model at
                # TP2 exported as stock exports it by test_verify_refit's llama-tied-tiny-2
                "llama-tied-tiny-tp2",
                # test_fp8's roundtrip at moe-tp2_ep2 (the CLI, Qwen3-MoE at TP2 x EP2); test_replicas'
                # dp2_tp2_ep2 (Qwen3-MoE loaded at TP2 x EP2, its BF16 export equal to the file)
                "qwen3-moe-tiny-tp2_ep2",
                # TP2 x PP2 by the README's main command; the MoE recipe's roundtrip by test_fp8's moe-tp2_ep2
                "qwen3-moe-tiny-tp2_pp2",
                # expert-TP 2 by test_trainer_truth's Megatron default expert-TP (loaded, exported exactly),
                # test_packed_broadcast's qwen3-moe-tp2_etp2 and test_sharded_refit's tp2_ep2_etp2
                "qwen3-moe-tiny-tp2_etp2",
            )
        ),
        *(
            f"tests/test_export.py::test_plan_and_cached_export[{c}]"
            for c in (
                "qwen3-tiny-tp1",  # test_layer_map[pp2-vpp2] (this checker on the same model); TP1 by the
                # conformance cell tp1-Qwen3ForCausalLM (equal to stock)
                "llama-tied-tiny-pp2",  # test_layer_map (this checker at PP2); the tied weight at PP2 by
                # test_engine_refit's and test_roundtrip's llama-tied-tiny-pp2
                "qwen3-moe-tiny-tp2_ep2_etp2",  # qwen3-moe-tiny-tp2_ep2 (this checker, Qwen3-MoE on 4 ranks);
                # expert-TP 2 by test_sharded_refit's tp2_ep2_etp2 (the same layout's slices, from the
                # placements, equal to the file) and test_packed_broadcast's qwen3-moe-tp2_etp2
            )
        ),
        # every check of this test (the four failures among them) at pp2_vpp2 and moe-tp2_etp2; one trainer
        # rank by test_fp8_stream_through_packed_broadcast
        "tests/test_packed_broadcast.py::test_packed_broadcast_ranks[qwen3-tp1]",
        # TP2 trainers by qwen3-moe-tp2_etp2; the StoreGroup joined by address by test_engine_refit's
        # test_broadcast_refit_into_engine_layout[qwen3-tiny-tp2] (a plan mismatch there fails every rank)
        "tests/test_packed_broadcast.py::test_packed_broadcast_ranks[qwen3-tp2-store_group]",
        "tests/test_engine_refit.py::test_broadcast_refit_into_engine_layout[qwen3-tiny-tp1]",  # qwen3-tiny-tp2
        # moe-tp2 (agreeing TP2 layouts, no byte moved); dense-tp1 (the dense MLP into the TP2 engine)
        "tests/test_sharded_engine_refit.py::test_sharded_refit_into_a_tp2_engine[dense-tp2]",
        # pp2_vpp2 and moe-tp2_ep2 (the same checks); the FP8 export of one trainer rank (TP1) by
        # test_fp8_stream_through_packed_broadcast
        "tests/test_fp8.py::test_roundtrip_fp8_matches_reference_quantizer[tp1]",
        # test_import_overwrite_replaces_the_checkpoint_and_keeps_other_files (exported at its saved layout,
        # TP1); other layouts than the saved one by test_import_export_across_layouts[moe-ep2-to-tp2],
        # test_replicas' test_export_from_megatron_with_replicas (PP2 to DP2 x TP2) and test_fp8's
        # test_megatron_checkpoint_export_to_fp8 (TP2 to PP2)
        *(
            f"tests/test_megatron_checkpoint.py::test_export_is_bitwise_exact_at_any_layout[{c}]"
            for c in ("tp2", "tp1")
        ),
        # qwen3-tiny-tp2 (dense adapters, the same eight checks) and qwen3-moe-tiny-tp1 (TP1)
        "tests/test_lora.py::test_lora_refit_matches_stock[qwen3-tiny-tp1]",
        # llama-tied-tiny-2 (the same float32 checks); qwen3-tiny at TP1 by test_readme_example_passes_by_default
        "tests/test_verify_refit.py::test_verifier_passes_after_refit[qwen3-tiny-1]",
        # tp 2: the zero-centred norms are replicated, views of their parameters as at TP1
        "tests/test_elementwise_ops.py::test_qwen3_next_cached_export_applies_the_op_once_and_leaves_the_norms_alone[1]",
        # test_convert_cli's test_launcher_bad_input_is_two_printed_once: the same 3 ranks at --tp 2, the
        # same message once, every rank's exit 2, nothing written
        "tests/test_replicas.py::test_layout_that_does_not_divide_the_world_names_both_numbers",
        # test_mismatch_on_one_rank_fails_every_rank_without_a_hang (a longer final norm); projection-smaller
        "tests/test_load_validation.py::test_mismatched_tensor_is_refused[norm-longer]",
        # NeMo-RL's conversion tasks (all, and a part) on Qwen3-MoE at EP2 by test_lora's
        # qwen3-moe-tiny-ep2-targets (its check_stock_calls); every task check at tp1 and tp2
        *(f"tests/test_dropin.py::test_stock_call[ep2-{c}]" for c in ("nemo_rl_tasks", "task_subsets")),
        # test_conformance's roundtrip cell ep2-Qwen3VLMoeForConditionalGeneration+packed_experts (launched
        # as `convert --nproc-per-node 2 roundtrip`, asserted exact); TP2 by the README's main command
        "tests/test_convert_cli.py::test_launcher_success_is_zero_and_exact",
    }
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: the cases of SLOW_CASES carry the marker by then
def pytest_collection_modifyitems(config, items):
    """Mark ``SLOW_CASES`` slow; deselect tests marked ``slow`` unless the run names a marker
    expression (``-m slow``, ``-m "slow or not slow"``) or names the test itself (``path::test`` or
    ``path::test[id]``)."""
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    if config.option.markexpr:
        return
    named = _named_tests(config)
    slow = [item for item in items if item.get_closest_marker("slow") and not _is_named(item.nodeid, named)]
    if slow:
        slow_ids = {id(item) for item in slow}
        items[:] = [item for item in items if id(item) not in slow_ids]
        config.hook.pytest_deselected(items=slow)


def _named_tests(config) -> list[str]:
    """The ``path::name`` arguments of the command line as node ids (relative to the root)."""
    named = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if sep:
            relative = os.path.relpath(Path(config.invocation_params.dir, path).resolve(), config.rootpath)
            named.append(f"{Path(relative).as_posix()}::{rest}")
    return named


def _is_named(nodeid: str, named: list[str]) -> bool:
    return any(nodeid == n or nodeid.startswith((f"{n}[", f"{n}::")) for n in named)


# --- Per-test times as they happen: MBRIDGE_TEST_TIMES=FILE appends "seconds nodeid" per test. -----
# pytest's --durations prints only once the run ends; a long run on 2 cores is read while it runs.
_TIMES = os.environ.get("MBRIDGE_TEST_TIMES")
_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum setup, call and teardown of each test; write the sum when its teardown is reported."""
    if not _TIMES:
        return
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        with open(_TIMES, "a") as handle:
            handle.write(f"{_SECONDS.pop(report.nodeid):.1f} {report.nodeid}\n")
