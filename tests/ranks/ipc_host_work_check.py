"""Host work of a steady colocated refit's trainer side (``engines.ipc.trainer.IpcSession.refit``), per
engine tensor, counted (not timed): run by tests/test_host_work.py in a process of its own (one CPU rank, TP1).

Usage: ipc_host_work_check.py --experts N [N ...] --result FILE [--fp8 [--stub-quantizer]]

For each expert count, builds the tiny Qwen3-MoE recipe with that many routed experts (every engine
tensor is then live: read by the engine from the trainer's parameters; with ``--fp8`` the weights
are quantized on the way, so they are exported every refit, into held buffers), refits an engine stand-in three
times (its workers only answer: the engine's replay is not the trainer's host work), then counts the
Python function calls and the calls into C that a fourth refit makes on the trainer, through
``sys.setprofile``. With ``--stub-quantizer`` the quantizer's device work (its kernel launches; on
the CPU the reference quantizer's torch calls, one set per weight) does nothing, so what is counted
is the host work around it, as on a GPU host where one grouped launch quantizes a bucket. Writes
{experts: {"tensors", "python_calls", "c_calls"}} to FILE.
"""

from __future__ import annotations

import functools
import sys

from host_work_check import count_calls, main

from mbridge_refit.engines.ipc.sharing import LocalTransport
from mbridge_refit.engines.ipc.trainer import IpcSession
from mbridge_refit.testing.many_experts import many_expert_model
from mbridge_refit.testing.silent_engine import answering_workers


def measure(experts: int, fp8: str | None = None) -> dict[str, int]:
    bridge, chunks = many_expert_model(experts)
    # FP8: the trainer's own quantize path (the engine quantizing, an FP8 step is the BF16 one on the trainer)
    session = IpcSession(answering_workers, transport=LocalTransport(), engine_quantizes=False)
    steps = [session.refit(bridge, chunks, fp8=fp8) for _ in range(3)]
    if not steps[0].opened or any(step.opened for step in steps[1:]):
        raise SystemExit(f"expected one open, then replays: {[step.opened for step in steps]}")

    def refit() -> int:
        return session.refit(bridge, chunks, fp8=fp8).tensors

    return count_calls(refit)


def stub_quantizer() -> None:
    """The quantizer's launches do nothing (the bits are not what is counted)."""
    from mbridge_refit.fp8.quantize import BucketQuantizer

    BucketQuantizer._launch_grouped = lambda self: None
    BucketQuantizer._quantize_singles = lambda self, *args, **kwargs: None


if __name__ == "__main__":
    fp8 = "--fp8" in sys.argv
    if fp8:
        sys.argv.remove("--fp8")
    if "--stub-quantizer" in sys.argv:
        sys.argv.remove("--stub-quantizer")
        stub_quantizer()
    main(functools.partial(measure, fp8="blockwise" if fp8 else None), __doc__)
