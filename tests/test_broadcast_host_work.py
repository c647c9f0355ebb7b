"""Host work of a steady broadcast refit on the engine's side stays flat per tensor (issue #31): the
calls the fourth refit of a session makes in the engine's thread are counted
(tests/ranks/broadcast_host_work_check.py), not timed.

Marginal cost per tensor (4 -> 32 vLLM-like layers, 224 tensors and 14 buckets more), checksums on:
before the replay (the engine's loader on every tensor every step, the plan parsed and the receive
buffers allocated every step) 34 Python calls, 29 calls into C, 2 host reads and 2 broadcasts per
bucket; replayed (each bucket's copies one ``torch._foreach_copy_``) 1.7 Python calls and 5.2 calls
into C per tensor (per bucket and per engine parameter: the check that none was reallocated), 3 host
reads and one broadcast per bucket plus two per refit, no allocation, no call of the loader.
"""

from __future__ import annotations

from conftest import marginal_calls

MAX_PYTHON_CALLS_PER_TENSOR = 2.5
MAX_C_CALLS_PER_TENSOR = 6.5
HOST_READS_PER_REFIT = 3  # the handshake's header and verdict, the status


def test_steady_broadcast_refit_host_calls_per_tensor_do_not_grow(tmp_path):
    calls = marginal_calls("broadcast_host_work_check.py", "--layers", (4, 32), tmp_path / "host_work.json")
    assert calls.added > 200 and calls.many["buckets"] > calls.few["buckets"] + 10, calls
    for counts in (calls.few, calls.many):
        assert counts["report"]["mode"] == "replayed" and counts["loader_calls"] == 0, counts
        assert counts["host_reads"] == HOST_READS_PER_REFIT, counts
        assert counts["collectives"] == {"broadcast": counts["buckets"] + 2, "all_reduce": 2}, counts
        assert "empty" not in counts["named"] and "zeros" not in counts["named"], counts  # nothing allocated
    assert calls.python_per_tensor <= MAX_PYTHON_CALLS_PER_TENSOR, calls
    assert calls.c_per_tensor <= MAX_C_CALLS_PER_TENSOR, calls
