"""sparsecc.ir.quant computes the same e4m3 codes and scales on the GPU as on the CPU, bit for bit:
its per-token scales (which sparsecc's rounding kernels compute too) are the correctly rounded
quotients amax / 448 on both, where torch on a GPU divides by a Python number through its rounded
reciprocal, a unit in the last place off for about half of all values."""
import pytest
import torch

from sparsecc.ir.quant import E4M3_MAX, amax_scale, quantize_input

pytestmark = pytest.mark.gpu


def test_scales_are_the_correctly_rounded_quotients_on_the_gpu(gen):
    amax = torch.rand(100_000, generator=gen) * 10.0 ** torch.randint(-6, 4, (100_000,), generator=gen)
    want = (amax.double() / E4M3_MAX).float()
    assert torch.equal(amax_scale(amax), want)
    assert torch.equal(amax_scale(amax.cuda()).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_token_rounding_is_the_same_on_both_devices(dtype, gen):
    x = (torch.randn(64, 4096, generator=gen) * 10.0 ** torch.randint(-4, 3, (64, 1), generator=gen)).to(dtype)
    codes, scales = quantize_input(x, None)
    codes_gpu, scales_gpu = quantize_input(x.cuda(), None)
    assert torch.equal(scales_gpu.cpu(), scales)
    assert torch.equal(codes_gpu.cpu().view(torch.uint8), codes.view(torch.uint8))
