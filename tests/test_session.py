"""convert.session: what a distributed session leaves set up for the model build."""

from __future__ import annotations

import datetime

import pytest
import torch

from mbridge_refit.convert.session import distributed_session
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.testing.conformance import restored_environment


@pytest.mark.parametrize("draws_before", [0, 3])
def test_the_cpu_generator_is_seeded_whatever_the_rank_drew_before(draws_before):
    """Megatron initialises router weights on the CPU: every rank of a tensor-parallel group must start
    the build from one CPU generator state, or their routers differ (seen on 2x H100: each vLLM worker
    then held its own trainer rank's router). A rank's earlier draws must not show."""
    expected = torch.Generator().manual_seed(0)
    torch.rand(draws_before)  # what one rank did before the session and another did not
    with (
        restored_environment(),
        distributed_session(ParallelLayout(), device=torch.device("cpu"), timeout=datetime.timedelta(minutes=1)),
    ):
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=expected))
