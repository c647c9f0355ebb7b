"""Host work per yielded tensor of a steady cached export stays flat (issue #32): the calls a third
export makes are counted (tests/ranks/host_work_check.py), not timed, so a loaded machine cannot
hide a regression or fake one. The same for the trainer's side of a steady colocated refit whose
tensors are all live (tests/ranks/ipc_host_work_check.py): it exports nothing, so its host work must
not grow with the tensors at all (at 9435c2a it grew by 2.3 Python calls and 1.3 calls into C per
tensor: the export looked up which buckets hold no name, and each live parameter's address took a
Python call).

The FP8 colocated refit exports every quantized weight and its scale each step, so its host work grows
with the tensors: bounded per tensor instead.

The bound is on the marginal cost: the calls that 56 more experts' tensors add, per tensor. At
1529460 (views made anew every export) that was 7.3 Python calls and 7.0 calls into C per tensor
(narrow, unsqueeze, reshape, detach among them); with views reused it is 3.0 and 4.7; with a bucket of views
kept whole while its parameters stay where they were (``PlanExporter._kept_views``), 1.0 and 2.0.
"""

from __future__ import annotations

from conftest import marginal_calls

MAX_PYTHON_CALLS_PER_TENSOR = 1.5
MAX_C_CALLS_PER_TENSOR = 2.5


def test_steady_export_host_calls_per_tensor_do_not_grow(tmp_path):
    calls = marginal_calls("host_work_check.py", "--experts", (8, 64), tmp_path / "host_work.json")
    assert calls.added > 500, calls
    assert calls.python_per_tensor <= MAX_PYTHON_CALLS_PER_TENSOR, calls
    assert calls.c_per_tensor <= MAX_C_CALLS_PER_TENSOR, calls


MAX_IPC_CALLS_PER_TENSOR = 0.1  # measured: 0.0 and 0.0 (104 Python calls and 50 into C a step, whatever the tensors)


def test_steady_colocated_refit_trainer_host_calls_do_not_grow_with_tensors(tmp_path):
    calls = marginal_calls("ipc_host_work_check.py", "--experts", (8, 64), tmp_path / "ipc_host_work.json")
    assert calls.added > 500, calls
    assert calls.python_per_tensor <= MAX_IPC_CALLS_PER_TENSOR, calls
    assert calls.c_per_tensor <= MAX_IPC_CALLS_PER_TENSOR, calls


# Measured 5.0 Python calls and 8.0 into C per tensor, all of them the CPU's reference quantizer, one set of
# torch calls per weight (on CUDA the grouped kernel quantizes a bucket in one launch): the host work around
# it is bounded on its own below. Before buckets were stamped (``runtime.stamps``) 6.0 and 12.0; 11.0 and
# 23.3 when every steady refit noted each exported tensor's place anew (``LayoutRecorder.add``) instead of
# finding the last refit's tensors where they were (``ExportSnapshot``), 7.0 and 13.3 before buckets of
# views were kept whole.
MAX_IPC_FP8_PYTHON_CALLS_PER_TENSOR = 5.5
MAX_IPC_FP8_C_CALLS_PER_TENSOR = 8.5


def test_steady_colocated_fp8_refit_trainer_host_calls_per_tensor_do_not_grow(tmp_path):
    """The FP8 refit exports every quantized weight and its scale each step (into held buffers): with the
    CPU's reference quantizer its host work grows with the tensors, by a bounded amount per tensor."""
    calls = marginal_calls("ipc_host_work_check.py", "--experts", (8, 64), tmp_path / "ipc_fp8.json", ("--fp8",))
    assert calls.added > 1000, calls
    assert calls.python_per_tensor <= MAX_IPC_FP8_PYTHON_CALLS_PER_TENSOR, calls
    assert calls.c_per_tensor <= MAX_IPC_FP8_C_CALLS_PER_TENSOR, calls


# Measured 0.0 and 0.0 (488 Python calls and 434 into C a step, whatever the experts): the expert buckets
# come stamped from the exporter, the quantizer's steady path launches and picks its outputs in C, and the
# session compares stamps, not tensors. Before the stamps (at 21a5024, ``quantize_blockwise`` stubbed): 4.5
# and 6.0 (the quantizer's per-weight output list and source checks, the exporter's pairs, the snapshot);
# with stamps but ``stamp_of`` always None: 0.5 and 3.5.
MAX_IPC_FP8_AROUND_QUANTIZE_CALLS_PER_TENSOR = 0.1


def test_steady_colocated_fp8_refit_host_work_around_the_quantize_does_not_grow(tmp_path):
    """With the quantizer's device work stubbed (as a GPU host's one launch a bucket), the FP8 refit's host
    work does not grow with the experts' tensors."""
    extra = ("--fp8", "--stub-quantizer")
    calls = marginal_calls("ipc_host_work_check.py", "--experts", (8, 64), tmp_path / "ipc_fp8_around.json", extra)
    assert calls.added > 1000, calls
    assert calls.python_per_tensor <= MAX_IPC_FP8_AROUND_QUANTIZE_CALLS_PER_TENSOR, calls
    assert calls.c_per_tensor <= MAX_IPC_FP8_AROUND_QUANTIZE_CALLS_PER_TENSOR, calls
