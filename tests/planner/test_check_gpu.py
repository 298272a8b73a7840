"""The whole-program race on the GPU: whether the dense program is bound by the host."""
import pytest
import torch

from sparsecc.planner.check import race

pytestmark = pytest.mark.gpu


def test_a_program_the_host_sets_the_pace_of_is_told_from_one_the_gpu_does():
    """Issuing a few tiny kernels among much Python keeps the GPU waiting (bound by the host);
    one large product per call keeps the host waiting (not)."""
    small = torch.randn(8, 8, device="cuda")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)

    def host_paced():
        sum(range(20000))
        return small + 1

    assert race(host_paced, host_paced, cuda=True).second_host_bound
    assert not race(host_paced, lambda: big @ big, cuda=True).second_host_bound
