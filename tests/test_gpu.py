"""GPU-only checks (skipped on CPU machines): TE layer spec, NCCL, CUDA caching allocator.

Run on the GPU host: ``python -m pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import datetime

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU host only)"),
]


@pytest.fixture(scope="module")
def tiny_gpu_model():
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models import recipes
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    layout = ParallelLayout()
    device = torch.device("cuda")
    with distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=5)):
        config = recipes.get_model_recipe("qwen3-tiny").to_hf_config()
        config.architectures = ["Qwen3ForCausalLM"]
        bridge = RefitBridge.from_hf_config(config)
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        yield bridge, chunks


def test_cached_export_allocates_nothing_after_first_call(tiny_gpu_model):
    bridge, chunks = tiny_gpu_model
    first = [
        (n, t.clone()) for n, t in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)
    ]
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        for _name, _tensor in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False):
            pass
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert len(first) == len(bridge.export_plan(chunks).entries)


def test_gpu_export_matches_stock_bitwise(tiny_gpu_model):
    from megatron.bridge import AutoBridge

    bridge, chunks = tiny_gpu_model
    stock = AutoBridge(bridge.hf_pretrained)
    expected = [(n, t.clone()) for n, t in stock.export_hf_weights(chunks, show_progress=False)]
    got = [
        (n, t.clone()) for n, t in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)
    ]
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name


def test_export_right_after_a_ddp_step(tmp_path):
    """Megatron DDP + distributed optimizer, overlap_param_gather off and on: the export right after
    optimizer.step() equals the optimizer's own result (scripts/check_ddp_export_gpu.py, in a
    fresh process with one rank per GPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    gpus = torch.cuda.device_count()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(gpus),
        str(repo / "scripts" / "check_ddp_export_gpu.py"),
        "--out-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "NCCL_NVLS_ENABLE": "0"}
    run = subprocess.run(cmd, cwd=repo / "scripts", env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]


@pytest.mark.parametrize("gpus", [1, 2], ids=["tp1", "tp2"])
def test_moe_with_megatrons_expert_tp_default_matches_stock(gpus, tmp_path):
    """A Qwen3-30B-A3B-shaped MoE (4 layers) built with the TE spec and Megatron's expert settings
    left at their defaults (expert-TP = TP): fast path, equal to stock, fresh after
    load_state_dict(assign=True) (scripts/check_trainer_truth_gpu.py, one rank per GPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    repo = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(gpus),
        str(repo / "scripts" / "check_trainer_truth_gpu.py"),
        "--pairs",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "NCCL_NVLS_ENABLE": "0"}
    run = subprocess.run(cmd, cwd=repo / "scripts", env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]


_IPC_ENGINE = """
import sys, torch
from mbridge_refit.engines.ipc.sharing import CudaIpcTransport
(storage,) = CudaIpcTransport().open(open(sys.argv[1], "rb").read(), torch.device("cuda", 0))
data = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)
print(storage.nbytes(), int(data.sum(dtype=torch.int64)))
data[1] = 7
torch.cuda.synchronize()
"""


def test_cuda_ipc_transport_opens_the_same_memory_in_another_process(tmp_path):
    """``CudaIpcTransport``'s JSON payload (no pickle) opens in another process as the trainer's own
    memory: the engine reads the trainer's bytes, and the trainer sees the engine's write."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    from mbridge_refit.engines.ipc.sharing import CudaIpcTransport

    source = (torch.arange(3001, device="cuda") % 251).to(torch.uint8)
    expected = (source.untyped_storage().nbytes(), int(source.sum(dtype=torch.int64)))  # before the engine writes
    payload = CudaIpcTransport().share([source.untyped_storage()])
    (tmp_path / "payload").write_bytes(payload)
    torch.cuda.synchronize()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", _IPC_ENGINE, str(tmp_path / "payload")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    nbytes, total = map(int, run.stdout.split()[-2:])
    assert (nbytes, total) == expected
    assert int(source[1]) == 7, "the engine wrote into other memory than the trainer's"


VLLM_CHECKS = {  # id -> (script, arguments, GPUs needed); each a process of its own (vLLM starts its engine in another)
    "colocated-ipc": ("check_vllm_refit_gpu.py", ["--model", "qwen3-1.7b", "--layers", "2"], 1),
    "broadcast-gloo-one-gpu": ("check_vllm_broadcast_gpu.py", ["--model", "qwen3-1.7b", "--layers", "2"], 1),
    "broadcast-nccl-other-gpu": (
        "check_vllm_broadcast_gpu.py",
        ["--model", "qwen3-1.7b", "--layers", "2", "--engine-gpu", "1"],
        2,
    ),
    "broadcast-nccl-other-gpu-fp8": (
        "check_vllm_broadcast_gpu.py",
        ["--model", "qwen3-1.7b", "--layers", "2", "--engine-gpu", "1", "--fp8"],
        2,
    ),
    "colocated-deepseek-v3-fp8": (
        "check_vllm_refit_gpu.py",
        ["--model", "deepseek-v3-cut", "--layers", "2", "--fp8"],
        1,
    ),
}


@pytest.mark.parametrize("case", list(VLLM_CHECKS))
def test_vllm_refit_equals_loading_from_disk(case, tmp_path):
    """The engine paths into a real vLLM engine: a cut shape refit equals the engine loaded from
    the checkpoint ``convert`` writes (every parameter fingerprint, prompt logprobs, a perturbed
    weight caught in its parameter; over NCCL also unmatched settings refused and injected faults
    raised on both sides); the scripts' docstrings list each check."""
    pytest.importorskip("vllm", reason="needs vLLM (the GPU host installs it with scripts/gpu/install-vllm.sh)")
    import os
    import subprocess
    import sys

    from conftest import REPO

    script, arguments, gpus = VLLM_CHECKS[case]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_USE_DEEP_GEMM": "0", "VLLM_BATCH_INVARIANT": "1"}
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *arguments, "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert run.stdout.rstrip().splitlines()[-1].startswith("OK"), run.stdout[-2000:]


def test_fp8_refit_into_vllm_with_deep_gemm_at_its_default(tmp_path):
    """vLLM's DeepGEMM as it comes (no VLLM_*DEEP_GEMM* variable set): on Hopper its block-FP8 linear layers
    are requantized to power-of-two scales after loading; the colocated refit has them processed again after
    its copies and equals the engine loaded from disk in every check of scripts/check_vllm_refit_gpu.py."""
    pytest.importorskip("vllm", reason="needs vLLM (the GPU host installs it with scripts/gpu/install-vllm.sh)")
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if "DEEP_GEMM" not in k}
    env |= {"PYTHONPATH": str(REPO), "VLLM_BATCH_INVARIANT": "1", "VLLM_DEEP_GEMM_WARMUP": "skip"}
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_vllm_refit_gpu.py"), "--model", "qwen3-1.7b"]
        + ["--layers", "4", "--fp8", "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert run.stdout.rstrip().splitlines()[-1].startswith("OK"), run.stdout[-2000:]


@pytest.mark.parametrize("fp8", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_sharded_refit_into_vllm_at_tp2_equals_loading_from_disk(fp8, tmp_path):
    """vLLM at tensor_parallel_size=2 on two GPUs, the trainer at TP2 on the same GPUs under
    torchrun: the sharded colocated refit equals the engine loaded from disk on every worker, BF16
    and blockwise FP8 (an engine started from the FP8 checkpoint, each rank quantizing its shards)
    (scripts/check_vllm_refit_tp2_gpu.py, whose docstring lists each check)."""
    pytest.importorskip("vllm", reason="needs vLLM (the GPU host installs it with scripts/gpu/install-vllm.sh)")
    import os
    import subprocess
    import sys

    from conftest import REPO

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_USE_DEEP_GEMM": "0", "VLLM_BATCH_INVARIANT": "1"}
    script = str(REPO / "scripts" / "check_vllm_refit_tp2_gpu.py")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, "--model", "qwen3-1.7b"]
        + ["--layers", "4", "--steps", "2", *fp8, "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    logged = f"OK vllm_refit_tp2_qwen3-1.7b-4layers{'_fp8' if fp8 else ''}.json"  # the script logs it
    assert logged in run.stdout + run.stderr, (run.stdout + run.stderr)[-2000:]


@pytest.mark.parametrize(
    ("interleave", "shape"),
    [(1, (1536, 2048)), (1, (2048, 768)), (2, (5760, 2880)), (1, (130, 70)), (2, (6, 3))],
    ids=["qwen3-vl-gate-up", "qwen3-vl-down", "gpt-oss-gate-up", "partial-tiles", "tiny-pairs"],
)
def test_stack_kernels_write_what_copy_into_writes(interleave, shape):
    """The Triton transposed stack (``runtime.stack_kernels``, through ``runtime.stack_fill``) against
    the layout's definition (``oracle.stacked_experts``), bitwise; twice, the second from the
    memoised address table."""
    from oracle import stacked_experts

    from mbridge_refit.plan.stacking import ExpertStack
    from mbridge_refit.runtime import stack_kernels
    from mbridge_refit.runtime.stack_fill import fill_stack

    assert stack_kernels.usable(torch.cuda.current_device())
    stack = ExpertStack(interleave=interleave, transpose=True)
    generator = torch.Generator().manual_seed(0)
    experts = [torch.randn(shape, generator=generator).to(torch.bfloat16).cuda() for _ in range(4)]
    expected = stacked_experts(experts, interleave=interleave, transpose=True)
    memo: dict = {}
    for _ in range(2):
        out = torch.full_like(expected, float("nan"))
        fill_stack(stack, out, experts, memo)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert len(memo) == 1


def test_replay_schedule_runs_plain_copies_as_one_chunked_launch():
    """``engines.replay.copy_batches`` on CUDA: an engine-like replay (each expert's gate and up rows into
    a stacked parameter, a dense weight, q of each query group from an interleaved QKV as one
    strided copy, a converting copy) runs its byte copies through
    ``engines.replay.copy_kernels.ChunkedCopies`` and the rest through ``_foreach_copy_``, and writes what
    a ``copy_`` per pair writes, bitwise, twice (the second from the kept chunk table)."""
    from mbridge_refit.engines.replay import copy_kernels
    from mbridge_refit.engines.replay.copy_batches import CopySchedule

    assert copy_kernels.usable(torch.cuda.current_device())
    generator = torch.Generator().manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16).cuda()

    w13 = torch.full((8, 2 * 768, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    dense = torch.full((1000, 24), float("nan"), dtype=torch.bfloat16, device="cuda")
    converted = torch.full((64,), float("nan"), dtype=torch.float32, device="cuda")
    pairs = [(w13[e, half * 768 : (half + 1) * 768], bf16(768, 256)) for e in range(8) for half in range(2)]
    interleaved, fused = bf16(4, 12, 512), torch.full((4, 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    pairs += [(dense, bf16(1000, 24)), (fused, interleaved[:, :8]), (converted, bf16(64))]
    schedule = CopySchedule()
    for destination, source in pairs:
        schedule.add(destination, source)
    schedule.barrier()
    assert sum(isinstance(call, copy_kernels.ChunkedCopies) for call in schedule.calls) == 1
    for step in range(2):
        for _, source in pairs:
            source.add_(1.0)
        schedule.run()
        for destination, source in pairs:
            assert torch.equal(destination, source.to(destination.dtype)), step


def test_job_quantizer_writes_unaligned_destinations_alone_with_the_reference_bits():
    """An engine's parameter view need not meet the grouped kernel's alignment (its stores are vectorized on
    16-byte hints): such a destination is quantized by the single kernel, an aligned one by the grouped
    launch, both with the reference's bits."""
    from mbridge_refit.fp8.format import FP8_DTYPE
    from mbridge_refit.fp8.quantize import JobQuantizer, block_row_jobs
    from mbridge_refit.fp8.reference import quantize_reference

    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 256, generator=generator) * 0.05).to(torch.bfloat16).cuda()
    memory = torch.zeros(2 * 300 * 256 + 8, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
    aligned, unaligned = memory[: 300 * 256].view(300, 256), memory[300 * 256 + 8 :].view(300, 256)
    scales = [torch.empty(3, 2, device="cuda") for _ in range(2)]
    runs = ((0, 0, 300),)
    quantizer = JobQuantizer(
        block_row_jobs(x, runs, aligned, scales[0]) + block_row_jobs(x, runs, unaligned, scales[1])
    )
    assert len(quantizer.grouped) == 1 and quantizer.alone == [1]
    quantizer.run()
    q, scale = quantize_reference(x.cpu())
    for out, out_scale in ((aligned, scales[0]), (unaligned, scales[1])):
        assert torch.equal(out.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(out_scale.cpu(), scale)


def test_shard_quantizer_groups_shards_into_one_launch_with_the_reference_bits():
    """The sharded FP8 refit's quantizer on CUDA: shards the grouped kernel reads in place (many
    expert-like shards, a partial edge block) go in one launch, a narrow one alone; every step
    writes ``quantize_reference``'s bits into the kept buffers."""
    from mbridge_refit.fp8.quantize import ShardQuantizer
    from mbridge_refit.fp8.reference import quantize_reference

    generator = torch.Generator().manual_seed(0)
    shapes = [(384, 256)] * 16 + [(300, 272), (128, 8)]
    sources = {
        f"s{i}": (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16).cuda()
        for i, shape in enumerate(shapes)
    }
    quantizer = ShardQuantizer(sources)
    assert len(quantizer.grouped) == 1 and [quantizer.jobs[i][0] is sources["s17"] for i in quantizer.alone] == [True]
    for step in range(2):
        quantizer.run()
        for name, source in sources.items():
            q, scale = quantize_reference(source.cpu())
            assert torch.equal(quantizer.q[name].cpu().view(torch.uint8), q.view(torch.uint8)), (name, step)
            assert torch.equal(quantizer.scales[name].cpu(), scale), (name, step)
        for source in sources.values():
            source.mul_(3)
