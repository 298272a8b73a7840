"""The e4m3 rounding every FP8 path shares (sparsecc.ir.quant), against its definition written out
step by step in fp32: bit for bit, on values spanning e4m3's range and past it, tiny ones that
underflow (negative ones too: stored as +0), infinities and NaN, for 16- and 32-bit inputs, per-row
and 0-d (static) scales."""
import pytest
import torch

from sparsecc.ir.quant import E4M3, E4M3_MAX, amax_scale, quantize_input, to_e4m3


def defined_e4m3(values, scale):
    """``values / scale`` in fp32, saturated at +-448, rounded to e4m3; every zero stored as +0."""
    scaled = torch.clamp(values.to(torch.float32) / scale.to(torch.float32), -E4M3_MAX, E4M3_MAX)
    codes = scaled.to(E4M3).view(torch.uint8)
    return torch.where(codes & 0x7F == 0, torch.zeros_like(codes), codes)


def awkward_rows(dtype, generator):
    x = torch.randn(16, 200, generator=generator) * torch.logspace(-10, 5, 200)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    x[1] = -1e-30                   # underflows, negative
    x[2] = 0.0
    x[3, 7] = -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rounding_is_its_definition_bit_for_bit(dtype, gen):
    x = awkward_rows(dtype, gen)
    per_row = amax_scale(x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1, keepdim=True))
    for scale in (per_row, torch.tensor(0.37), torch.tensor(3e-4), torch.tensor(1.0, dtype=torch.float64)):
        got = to_e4m3(x, scale)
        assert got.dtype == E4M3 and got.shape == x.shape
        assert torch.equal(got.view(torch.uint8), defined_e4m3(x, scale)), scale
    assert (to_e4m3(x, torch.tensor(1.0)).view(torch.uint8)[1:3] == 0).all()      # underflow: +0, never 0x80


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_per_token_scales_are_each_rows_largest_magnitude(dtype, gen):
    """s_x = max |x[m, :]| / 448 (1 for a row of zeros, and for a row with a NaN, whose outputs are
    NaN anyway); an infinite entry makes the row's scale infinite."""
    x = awkward_rows(dtype, gen)
    x_q, scale = quantize_input(x, None)
    largest = x.float().abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale, torch.where(largest > 0, largest / E4M3_MAX, torch.ones_like(largest)))
    assert scale[0].item() == 1.0 and scale[2].item() == 1.0 and scale[3].item() == float("inf")
    assert torch.equal(x_q.view(torch.uint8), defined_e4m3(x, scale))
    static = torch.tensor(0.5)
    x_q, same = quantize_input(x, static)
    assert same.item() == 0.5 and torch.equal(x_q.view(torch.uint8), defined_e4m3(x, static))
    assert quantize_input(x[:, :0], None)[1].tolist() == [[1.0]] * x.shape[0]
