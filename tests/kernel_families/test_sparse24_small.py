"""The small-batch kernels' 2:4 layouts, packed and unpacked with torch ops on any device: the
CUDA-core kernel's (sparsecc.kernels.sparse24_small.Sparse24GemvWeight: kept values and 16-bit
positions per row) and the tensor-core kernel's (sparsecc.kernels.sparse24_small.Sparse24MmaWeight:
units of 16 x 64 in fragment order, zero-padded). Exact round trips, including groups with fewer
than two non-zeros, the documented bit and fragment orders, and clear errors for weights that
are not 2:4."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecc.errors import InputError
from sparsecc.kernels.sparse24_small import Sparse24GemvWeight, Sparse24MmaWeight

from conftest import n_m


def _expected_layout(packing, rows: int, k: int, dtype) -> tuple:
    """(values shape, metadata shape and dtype, the 16-bit weight bytes the layout's 9/16 is of)."""
    if packing is Sparse24GemvWeight:
        return (rows, k // 2), (rows, k // 16), torch.int16, rows * k
    units = (-(-rows // 16), -(-k // 64))          # whole units of 16 rows x 64 inputs, zero-padded
    return (*units, 512), (*units, 32), torch.int32, units[0] * 16 * units[1] * 64


@pytest.mark.parametrize("packing", [Sparse24GemvWeight, Sparse24MmaWeight])
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), chunks=st.integers(1, 9), keep=st.sampled_from([0, 1, 2]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_round_trip_is_exact(packing, rows, chunks, keep, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = n_m(rows, 16 * chunks, 2, 4, gen, dtype)
    if keep < 2:                                   # thinner groups: one or no non-zero
        weight = n_m(rows, 16 * chunks, keep, 4, gen, dtype) if keep else torch.zeros(rows, 16 * chunks, dtype=dtype)
    packed = packing.pack(weight)
    values, metadata, metadata_dtype, padded = _expected_layout(packing, rows, 16 * chunks, dtype)
    assert packed.values.shape == values and packed.metadata.shape == metadata
    assert packed.metadata.dtype == metadata_dtype and packed.values.dtype == dtype
    assert torch.equal(packed.to_dense(), weight)
    assert packed.nbytes * 16 == padded * weight.element_size() * 9 or dtype == torch.float32


def test_indices_are_in_the_documented_bit_order():
    weight = torch.zeros(1, 16)
    weight[0, [1, 3, 4, 6, 8, 9, 14, 15]] = torch.arange(1.0, 9.0)    # groups: (1,3) (0,2) (0,1) (2,3)
    packed = Sparse24GemvWeight.pack(weight)
    expected = (1 | 3 << 2) | (0 | 2 << 2) << 4 | (0 | 1 << 2) << 8 | (2 | 3 << 2) << 12
    assert int(packed.metadata[0, 0]) & 0xFFFF == expected
    assert packed.values.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]


def test_units_hold_the_tensor_core_fragments_in_the_documented_order():
    """Lane 4g + t of a 32-input half holds kept columns 2t, 2t + 1 of row g, the same of row
    g + 8, then columns 2t + 8, 2t + 9 of row g and of row g + 8; metadata lane 4q + 2 * half +
    piece holds the 16 inputs' codes of rows q (low 16 bits) and q + 8 (high)."""
    weight = torch.zeros(16, 64)
    weight[0, [1, 3, 4, 6, 8, 9, 14, 15]] = torch.arange(1.0, 9.0)    # groups: (1,3) (0,2) (0,1) (2,3)
    weight[9, 32 + 16 + 2] = 10.0          # row 9, second half, piece 1, group 0, position 2
    packed = Sparse24MmaWeight.pack(weight)
    values = packed.values[0, 0].reshape(2, 32, 8)          # half, lane, 8 values
    for t in range(4):                                      # row 0's kept pairs: groups t of piece 0
        assert values[0, t, :2].tolist() == [2.0 * t + 1, 2.0 * t + 2]
    # row 9 = g 1 + 8 keeps positions 0 and 2 of input group 4 of the second half: compressed
    # columns 8 (a zero) and 9 (the 10), so lane 4 * 1 + 0, value 7 (row g + 8, column 2t + 9)
    assert values[1, 4, 7].item() == 10.0 and values[1, 4, 6].item() == 0.0
    expected = (1 | 3 << 2) | (0 | 2 << 2) << 4 | (0 | 1 << 2) << 8 | (2 | 3 << 2) << 12
    words = packed.metadata[0, 0].to(torch.int64) & 0xFFFFFFFF
    assert int(words[0]) & 0xFFFF == expected                # lane 0: row 0, piece 0 of the first half
    assert (int(words[4 * 1 + 2 + 1]) >> 16) & 0xF == (0 | 2 << 2)   # lane 7: row 9, piece 1 of the second half
    assert torch.equal(packed.to_dense(), weight)


@pytest.mark.parametrize("packing", [Sparse24GemvWeight, Sparse24MmaWeight])
def test_not_2_4_or_misshaped_is_refused(packing):
    with pytest.raises(InputError, match="more than two non-zeros"):
        packing.pack(torch.ones(4, 16))
    with pytest.raises(InputError, match="K % 16"):
        packing.pack(torch.zeros(4, 12))
