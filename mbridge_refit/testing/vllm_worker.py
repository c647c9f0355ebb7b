"""The vLLM worker extension the GPU checks and benchmarks load: the production extension
(``engines.vllm.worker.RefitWorkerExtension``) plus RPCs only they call (overwrite every
parameter with noise, time the engine-side application, read the allocator's counters, say what DeepGEMM
does in the engine).

``engine_kwargs(worker_extension_cls=TESTING_WORKER_EXTENSION)`` starts an engine with it. Test
support: production code never imports this module (``tests/test_package.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from mbridge_refit.engines.vllm.worker import RefitWorkerExtension

__all__ = ["TESTING_WORKER_EXTENSION", "TestingWorkerExtension"]

TESTING_WORKER_EXTENSION = "mbridge_refit.testing.vllm_worker.TestingWorkerExtension"


class TestingWorkerExtension(RefitWorkerExtension):
    """``RefitWorkerExtension`` with the checks' and benchmarks' own RPCs (same prefix)."""

    def mbridge_refit_scramble(self, seed: int) -> int:
        """Overwrite every floating-point parameter with noise (tests: a later refit must write
        everything back); returns how many parameters it changed."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        count = 0
        with torch.no_grad():
            for _, param in self.model_runner.get_model().named_parameters():
                noise = torch.rand(param.shape, generator=generator, device=param.device, dtype=torch.float32)
                param.data.copy_(
                    noise.to(param.dtype) if param.dtype.is_floating_point else noise.mul(7).to(param.dtype)
                )
                count += 1
        torch.cuda.synchronize(self.device)
        return count

    def mbridge_refit_time(self, what: str, repeats: int) -> list[float]:
        """Benchmarks: milliseconds of ``repeats`` engine-side applications of the open layout,
        ``what="replay"`` (the recorded copies) or ``"load_weights"`` (vLLM's own loader on the
        same tensors, already on this GPU; inside its layerwise reload where the layout was
        recorded through it, as for FP8 engines); each synchronized. Or the host's part of an apply
        before its copies run: ``"check"`` (the look for replaced parameters) and ``"launch"`` (the
        replay's calls returning, not waited for; synchronized after the clock stops)."""
        receiver = self._mbridge_receiver()
        if not receiver.is_open:
            raise RuntimeError("no refit layout is open: refit once before timing")
        plan = receiver.plan
        model = self.model_runner.get_model()
        sources = [(step.name, step.source) for step in plan.steps]
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            if what == "check":
                plan.targets_moved(model)
            elif what in ("launch", "replay"):
                plan.replay()
            else:
                staged = receiver.staged_load
                with staged.around() if staged is not None else contextlib.nullcontext():
                    model.load_weights(sources)
            if what not in ("check", "launch"):  # those two time the host's part only
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize(self.device)
        return times

    def mbridge_refit_last_go_ahead(self) -> dict[str, Any]:
        """Benchmarks: the last early apply's go-ahead, its way and wait (``RefitReceiver.last_go_ahead``)."""
        return self._mbridge_receiver().last_go_ahead

    def mbridge_refit_memory(self) -> dict[str, Any]:
        """The worker's CUDA caching-allocator counters (mapped IPC memory is not among them)."""
        stats = torch.cuda.memory_stats(self.device)
        return {
            "allocated_bytes": torch.cuda.memory_allocated(self.device),
            "reserved_bytes": torch.cuda.memory_reserved(self.device),
            "allocations": stats.get("allocation.all.allocated", 0),
        }

    def mbridge_refit_load_shared(self, wires: list, payloads: list, transport: str) -> float:
        """Benchmarks' baseline at engine TP > 1: vLLM's own ``load_weights`` on full-size tensors
        that the trainer rank on this worker's GPU shares (its gathering export), this worker's entry
        of every rank's layout (``engines.ipc.sharded.worker_entry``). Mapped once per layout;
        returns the milliseconds of the load, synchronized."""
        from mbridge_refit.engines.ipc.sharded import worker_entry
        from mbridge_refit.engines.ipc.sharing import TRANSPORTS, SharedLayout, views
        from mbridge_refit.engines.vllm.worker import _worker_index

        rank = _worker_index(self)
        layout = SharedLayout.from_wire(worker_entry(wires, rank, "layout"))
        mapped = getattr(self, "_mbridge_shared_load", None)
        if mapped is None or mapped[0] != layout.fingerprint:
            device = torch.device(self.device)
            storages = TRANSPORTS[transport]().open(worker_entry(payloads, rank, "payload"), device)
            mapped = self._mbridge_shared_load = (layout.fingerprint, views(layout, storages, device), storages)
        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self.model_runner.get_model().load_weights(mapped[1])
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - started) * 1e3

    def mbridge_refit_deep_gemm(self) -> dict[str, Any]:
        """What DeepGEMM does in this worker: the DeepGEMM variables as its process sees them ("unset" where
        unset), its block-FP8 linear layers and MoE layers that run DeepGEMM (``engines.vllm.deep_gemm``), and
        whether the linear kernels requantize to E8M0 (power-of-two) scales."""
        import os

        from mbridge_refit.engines.vllm.deep_gemm import deep_gemm_experts, deep_gemm_linear

        names = ("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0", "VLLM_DEEP_GEMM_WARMUP")
        modules = list(self.model_runner.get_model().named_modules())
        linear = [name for name, module in modules if deep_gemm_linear(module)]
        kernels = [getattr(module.quant_method, "fp8_linear", None) for name, module in modules if name in linear]
        e8m0 = {bool(getattr(getattr(k, "fallback", k), "use_deep_gemm_e8m0", False)) for k in kernels}
        return {
            "env": {name: os.environ.get(name, "unset") for name in names},
            "linear": linear,
            "experts": [name for name, module in modules if deep_gemm_experts(module)],
            "e8m0": sorted(e8m0),
        }

    def mbridge_refit_lora_slots_differ(self, lora_id: int, other_id: int) -> list[str]:
        """The LoRA modules whose GPU slots of two active adapters hold different bytes (every stacked
        A and B buffer of the module, the whole slot: zero padding past the rank included)."""
        manager = self.model_runner.lora_manager._adapter_manager
        index, other = manager.lora_index_to_id.index(lora_id), manager.lora_index_to_id.index(other_id)
        differ = []
        for name, module in manager.modules.items():
            stacked = [
                *_buffers(getattr(module, "lora_a_stacked", ())),
                *_buffers(getattr(module, "lora_b_stacked", ())),
            ]
            if any(not torch.equal(buffer[index], buffer[other]) for buffer in stacked):
                differ.append(name)
        return differ


def _buffers(stacked: Any) -> list[torch.Tensor]:
    """A LoRA module's stacked buffers: a tuple of them (linear layers, one per slice) or one tensor
    (the logits processor's, the embedding's), each indexed by slot first."""
    return [stacked] if isinstance(stacked, torch.Tensor) else list(stacked)
