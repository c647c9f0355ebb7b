"""The packed broadcast's bounded copies and checksums (``engines.broadcast.bounded_kernels``) give torch's results:
the Triton kernels themselves in Triton's CPU interpreter (tests/ranks/bounded_kernels_check.py, torch's
copy and ``broadcast_wire.checksum_into`` the oracles), and where they do not apply (CPU, small or
unaligned bytes, ``device_programs=0``) torch's kernels run. On the GPU host every broadcast refit
runs them, its checksums compared end to end (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_interpreted

from mbridge_refit.engines.broadcast.bounded_kernels import BoundedKernels
from mbridge_refit.engines.broadcast.wire import PackedBroadcastConfig, checksum_into


def test_the_kernels_copy_and_sum_as_torch_does_in_tritons_interpreter():
    run_interpreted("bounded_kernels_check.py", "bounded kernels match torch")


def test_on_cpu_and_with_no_programs_torchs_kernels_run():
    for kernels in (BoundedKernels(torch.device("cpu"), 64), BoundedKernels(torch.device("cpu"), 0, enabled=True)):
        assert not kernels.enabled
        data = torch.randint(0, 256, ((1 << 20) + 3,), dtype=torch.uint8)
        ours, expected = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        kernels.checksum_into(data, ours)
        checksum_into(data, expected)
        assert int(ours) == int(expected)
        copied = torch.empty_like(data)
        kernels.copy(copied, data)
        assert torch.equal(copied, data)


def test_device_programs_is_checked():
    assert PackedBroadcastConfig().device_programs == 64
    assert PackedBroadcastConfig(device_programs=0).device_programs == 0
    with pytest.raises(ValueError, match="device_programs"):
        PackedBroadcastConfig(device_programs=-1)
