"""The small-batch kernels' 2:4 layout (sparsecc.gpu.Sparse24GemvWeight), packed and unpacked
with torch ops on any device: exact round trips, including groups with fewer than two
non-zeros, and clear errors for weights that are not 2:4."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecc.errors import InputError
from sparsecc.gpu import Sparse24GemvWeight

from conftest import n_m


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), chunks=st.integers(1, 8), keep=st.sampled_from([0, 1, 2]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_round_trip_is_exact(rows, chunks, keep, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = n_m(rows, 16 * chunks, 2, 4, gen, dtype)
    if keep < 2:                                   # thinner groups: one or no non-zero
        weight = n_m(rows, 16 * chunks, keep, 4, gen, dtype) if keep else torch.zeros(rows, 16 * chunks, dtype=dtype)
    packed = Sparse24GemvWeight.pack(weight)
    assert packed.values.shape == (rows, 8 * chunks) and packed.metadata.shape == (rows, chunks)
    assert packed.metadata.dtype == torch.int16 and packed.values.dtype == dtype
    assert torch.equal(packed.to_dense(), weight)
    assert packed.nbytes * 16 == weight.numel() * weight.element_size() * 9 or dtype == torch.float32


def test_indices_are_in_the_documented_bit_order():
    weight = torch.zeros(1, 16)
    weight[0, [1, 3, 4, 6, 8, 9, 14, 15]] = torch.arange(1.0, 9.0)    # groups: (1,3) (0,2) (0,1) (2,3)
    packed = Sparse24GemvWeight.pack(weight)
    expected = (1 | 3 << 2) | (0 | 2 << 2) << 4 | (0 | 1 << 2) << 8 | (2 | 3 << 2) << 12
    assert int(packed.metadata[0, 0]) & 0xFFFF == expected
    assert packed.values.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]


def test_not_2_4_or_misshaped_is_refused():
    with pytest.raises(InputError, match="more than two non-zeros"):
        Sparse24GemvWeight.pack(torch.ones(4, 16))
    with pytest.raises(InputError, match="K % 16"):
        Sparse24GemvWeight.pack(torch.zeros(4, 12))
