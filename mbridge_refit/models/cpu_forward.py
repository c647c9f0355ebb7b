"""Running a forward pass of a CPU-built Megatron model (the refit verifier's trainer side on CPU).

Megatron-Core assumes CUDA in four places a forward pass reaches with the local layer spec:
the block's final norm is Transformer Engine's ``RMSNorm`` (CUDA kernels) even there;
``RotaryEmbedding.get_emb`` moves ``inv_freq`` to the current CUDA device; the attention's
scratch tensors come from ``parallel_state``'s ``GlobalMemoryBuffer``, which allocates on CUDA;
and attention dropout forks the CUDA RNG tracker (even in eval mode, where dropout is the
identity). ``cpu_forward(chunks)`` covers them for the duration of a ``with`` block: the model's
rotary modules and TE RMSNorms get subclasses that compute with torch ops on the CPU (this model
only; the norm in fp32, as Hugging Face's RMSNorm does); Megatron's global memory
buffer and RNG tracker are swapped for CPU ones (a buffer allocating on the CPU, a tracker whose
``fork`` does nothing) and restored afterwards. Nothing in torch is touched. Use it for
eval-mode forwards only: dropout would not be seeded per model-parallel rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

__all__ = ["cpu_forward"]


@contextlib.contextmanager
def cpu_forward(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Let ``chunks`` (built on the CPU) run forward inside the block."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    _swap_cuda_only_modules(chunks)
    saved = (
        parallel_state._GLOBAL_MEMORY_BUFFER,
        megatron_random._CUDA_RNG_STATE_TRACKER,
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    parallel_state._GLOBAL_MEMORY_BUFFER = _classes()[1]()
    megatron_random._CUDA_RNG_STATE_TRACKER = _NoRNGTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        yield
    finally:
        (
            parallel_state._GLOBAL_MEMORY_BUFFER,
            megatron_random._CUDA_RNG_STATE_TRACKER,
            megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        ) = saved


class _NoRNGTracker:
    """Stands in for Megatron's CUDA RNG tracker during an eval-mode CPU forward."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()


def _swap_cuda_only_modules(chunks: list[torch.nn.Module]) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from transformer_engine.pytorch import RMSNorm

    rotary, _, norm = _classes()
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is RotaryEmbedding:
                module.__class__ = rotary
            elif type(module) is RMSNorm:
                module.__class__ = norm


_CLASSES: tuple | None = None


def _classes() -> tuple[type, type, type]:
    """(CPU rotary embedding, CPU global memory buffer, CPU RMSNorm), defined once on first use."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from megatron.core.utils import GlobalMemoryBuffer
    from transformer_engine.pytorch import RMSNorm

    class CPURotaryEmbedding(RotaryEmbedding):
        """``RotaryEmbedding`` computing on the device ``inv_freq`` is on (upstream forces CUDA)."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            if not self.rotary_interleaved:
                emb = torch.cat((freqs, freqs), dim=-1)
            else:
                emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
            return emb[:, None, None, :]

    class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
        """``GlobalMemoryBuffer`` allocating on the CPU (upstream allocates on CUDA)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = math.prod(tensor_shape)
            buffer = self.buffer.get((name, dtype))
            if buffer is None or buffer.numel() < required:
                buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
            return buffer[:required].view(*tensor_shape)

    class CPURMSNorm(RMSNorm):
        """Transformer Engine ``RMSNorm`` computed with torch ops (fp32 statistics, like HF's RMSNorm)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = self.weight + 1 if self.zero_centered_gamma else self.weight
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            return weight * y.to(x.dtype)

    _CLASSES = (CPURotaryEmbedding, CPUGlobalMemoryBuffer, CPURMSNorm)
    return _CLASSES
