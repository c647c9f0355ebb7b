"""engines.replay.copy_batches: recorded copies grouped for ``torch._foreach_copy_`` only where independent.

On CPU ``_foreach_copy_`` copies in list order, so a group that should have been split would still
give the right bytes here; the schedule's structure (which copies share a call) is what these tests
check, against hand-written expectations, and the bytes against plain sequential copies.
"""

from __future__ import annotations

import torch
from conftest import run_interpreted

from mbridge_refit.engines.replay.apply_plan import ApplyPlan
from mbridge_refit.engines.replay.copy_batches import CopySchedule, byte_span


def _groups(schedule: CopySchedule) -> int:
    schedule.barrier()
    return len(schedule.calls)


def test_independent_copies_into_one_stacked_tensor_are_one_call():
    stacked = torch.zeros(8, 3, 4)
    experts = [torch.randn(3, 4) for _ in range(8)]
    schedule = CopySchedule()
    for index, expert in enumerate(experts):
        schedule.add(stacked[index], expert)
    assert _groups(schedule) == 1 and schedule.copies == 8
    schedule.run()
    assert torch.equal(stacked, torch.stack(experts))


def test_a_copy_reading_what_an_earlier_one_wrote_runs_after_it():
    source, middle, target = torch.randn(16), torch.zeros(16), torch.zeros(16)
    schedule = CopySchedule()
    schedule.add(middle, source)
    schedule.add(target[:8], middle[4:12])  # reads bytes the first copy writes
    assert _groups(schedule) == 2
    schedule.run()
    assert torch.equal(target[:8], source[4:12])


def test_overlapping_writes_keep_their_order():
    target = torch.zeros(10)
    schedule = CopySchedule()
    schedule.add(target[:6], torch.ones(6))
    schedule.add(target[4:], torch.full((6,), 2.0))  # the later copy wins bytes 4-5
    assert _groups(schedule) == 2
    schedule.run()
    assert target.tolist() == [1.0] * 4 + [2.0] * 6


def test_a_write_over_what_an_earlier_copy_reads_waits_for_it():
    buffer, out = torch.arange(8.0), torch.zeros(4)
    schedule = CopySchedule()
    schedule.add(out, buffer[:4])
    schedule.add(buffer[:4], torch.zeros(4))
    assert _groups(schedule) == 2
    schedule.run()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_dtype_pairs_are_separate_calls_of_one_group():
    schedule = CopySchedule()
    schedule.add(torch.zeros(4), torch.ones(4, dtype=torch.bfloat16))  # an fp32 router from a bf16 export
    schedule.add(torch.zeros(4), torch.ones(4))
    assert _groups(schedule) == 2  # two dtype keys, no dependency between them
    schedule = CopySchedule()
    schedule.add(torch.zeros(4), torch.ones(4))
    schedule.add(torch.zeros(4), torch.ones(4))
    assert _groups(schedule) == 1


def test_a_call_is_a_barrier():
    seen = []
    target = torch.zeros(2)
    schedule = CopySchedule()
    schedule.add(target, torch.ones(2))
    schedule.call(lambda: seen.append(target.clone()))
    schedule.add(target, torch.full((2,), 3.0))
    schedule.barrier()
    assert len(schedule.calls) == 3
    schedule.run()
    assert seen[0].tolist() == [1.0, 1.0] and target.tolist() == [3.0, 3.0]


def test_byte_span_of_strided_views():
    base = torch.zeros(4, 6, dtype=torch.float32)
    storage = base.untyped_storage().data_ptr()
    assert byte_span(base[1]) == (storage, 24, 48)
    assert byte_span(base[:, 2]) == (storage, 8, 8 + (3 * 6 + 1) * 4)  # column: first to last element
    assert byte_span(base.t()[2:4]) == (storage, 8, 8 + (1 + 3 * 6 + 1) * 4)


class _Stacked(torch.nn.Module):
    """A MoE engine layer: every expert's weight copied into one stacked parameter by its loader."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(experts, 2, 3), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            self.w[int(name.split(".")[1])].copy_(tensor)


def test_replay_of_a_stacked_layer_is_one_foreach_call(monkeypatch):
    model = _Stacked(16)
    sources = [(f"experts.{e}.weight", torch.randn(2, 3)) for e in range(16)]
    plan = ApplyPlan.record(model, sources)
    plan.check_against_loader()
    calls = []
    foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(len(d)), foreach(d, s)))
    for _, tensor in sources:
        tensor.add_(1.0)  # the next step's bytes, in the same storages
    plan.replay()
    assert calls == [16]
    assert torch.equal(model.w, torch.stack([tensor for _, tensor in sources]))


def test_chunk_rows_cover_every_byte_once():
    """Copies cut into (source, destination, 8-byte words) chunks, in order, tails shorter."""
    from mbridge_refit.engines.replay.copy_kernels import chunk_rows

    rows = chunk_rows([(1000, 50_000, 16), (2000, 60_000, 80)], chunk_bytes=32)
    assert rows == [(1000, 50_000, 2), (2000, 60_000, 4), (2032, 60_032, 4), (2064, 60_064, 2)]


def test_chunked_copy_kernel_writes_what_copy_writes():
    """``engines.replay.copy_kernels``' Triton kernel run by Triton's CPU interpreter against ``copy_``
    (tests/ranks/chunked_copy_kernel_check.py); on a GPU its probe checks it again before use and
    tests/test_gpu.py replays through it."""
    run_interpreted("chunked_copy_kernel_check.py", "chunked copies == copy_")


def test_byte_segments_of_plain_strided_and_refused_copies():
    """A contiguous copy is one segment; equally spaced row runs (q of each query group in a fused
    QKV) one per run, at the runs' addresses; conversions, transposes, conjugate views, overlapping
    or expanded destinations, wrapper subclasses and runs shorter than ``MIN_SEGMENT_BYTES`` are not
    byte copies."""
    from mbridge_refit.engines.replay.copy_kernels import MIN_SEGMENT_BYTES, byte_segments

    source, destination = torch.zeros(4, 1024, dtype=torch.bfloat16), torch.zeros(4, 1024, dtype=torch.bfloat16)
    assert byte_segments(destination, source) == [(source.data_ptr(), destination.data_ptr(), 8192)]
    interleaved = torch.zeros(4, 12, 1024, dtype=torch.bfloat16)  # 4 groups of 8 q rows and 4 k/v rows
    fused = torch.zeros(4, 8, 1024, dtype=torch.bfloat16)
    row = 1024 * 2
    assert byte_segments(fused, interleaved[:, :8]) == [
        (interleaved.data_ptr() + g * 12 * row, fused.data_ptr() + g * 8 * row, 8 * row) for g in range(4)
    ]
    assert byte_segments(destination.float(), source) is None  # a conversion
    assert byte_segments(destination, source.t().contiguous().t()) is None  # a transposing copy
    complex_source = torch.zeros(4096, dtype=torch.complex64)
    assert byte_segments(torch.zeros_like(complex_source), complex_source.conj()) is None  # bytes are not values
    row = torch.zeros(4096, dtype=torch.bfloat16)
    overlapping = torch.zeros(8192, dtype=torch.bfloat16).as_strided((2, 4096), (2048, 1))
    assert byte_segments(overlapping, torch.stack([row, row])) is None  # copy_ writes it in order; chunks would race
    assert byte_segments(row.view(1, 4096).expand(3, 4096), torch.zeros(3, 4096, dtype=torch.bfloat16)) is None
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass: no data pointer of its own

    assert byte_segments(TwoTensor(destination.clone(), destination.clone()), source) is None
    short = MIN_SEGMENT_BYTES // 2 // 2  # bf16 elements in half the minimum
    assert (
        byte_segments(
            torch.zeros(3, short, dtype=torch.bfloat16), torch.zeros(3, 2 * short, dtype=torch.bfloat16)[:, :short]
        )
        is None
    )
