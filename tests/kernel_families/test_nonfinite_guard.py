"""sparsecc.kernels.nonfinite_guard and the BSR packing's covered block columns: which inputs the NaN
pass must read on every call, and where a 2:4 weight keeps its guard (CPU; the kernels' use
of the guard is tested in kernels/test_bsr_gpu.py and test_bad_input_gpu.py)."""
import pytest
import torch

from sparsecc.errors import InputError
from sparsecc.ir.formats import BSRWeight, FormatError
from sparsecc.kernels import nonfinite_guard
from sparsecc.kernels.bsr import BsrKernelWeight
from sparsecc.kernels.nonfinite_guard import GROUP, HEADER_WORDS, cover_block_columns, groups_of, guard_words


def test_guard_lists_the_groups_holding_an_unmet_input():
    unmet = torch.zeros(64, dtype=torch.bool)
    unmet[[3, 40, 41, 63]] = True
    guard = guard_words(unmet)
    assert guard.dtype == torch.int32 and guard[:HEADER_WORDS].tolist() == [0, 0, 3]
    assert groups_of(guard).tolist() == [0, 5, 7] and guard.numel() == HEADER_WORDS + 3
    assert groups_of(guard_words(torch.zeros(32, dtype=torch.bool))).numel() == 0


def test_inputs_not_in_whole_groups_are_refused():
    with pytest.raises(InputError, match=f"groups of {GROUP}"):
        guard_words(torch.zeros(12, dtype=torch.bool))


def test_covering_adds_one_block_per_empty_column_to_the_shortest_rows(gen):
    present = torch.rand(6, 20, generator=gen) < 0.15
    present[:, [2, 7, 8]] = False
    covered = cover_block_columns(present)
    assert covered.any(dim=0).all() and (covered & ~present).sum() == (~present.any(dim=0)).sum()
    assert torch.equal(covered[:, present.any(dim=0)], present[:, present.any(dim=0)])
    lengths = present.sum(dim=1)
    for column in (~present.any(dim=0)).nonzero().flatten().tolist():   # the same greedy choice, by hand
        row = min(range(6), key=lambda r: (lengths[r], r))
        assert covered[row, column]
        lengths[row] += 1


def test_a_stored_mask_must_keep_every_nonzero_block():
    with pytest.raises(FormatError, match="dropped a block"):
        BSRWeight.from_dense(torch.ones(32, 32), (16, 16), stored=lambda present: present & False)


@pytest.mark.parametrize("cover", [True, False])
def test_bsr_packing_covers_empty_block_columns_or_lists_them(cover, gen):
    """A block column no block row stores: covered by a block of zeros (nothing listed in the
    guard), or left out and its groups listed; exact either way."""
    weight = torch.randn(64, 128, generator=gen)
    weight[:, 32:64] = 0                              # block column 1 of four (32 wide) is empty
    weight[:16, 96:] = 0                              # block (0, 3) empty, column 3 stored elsewhere
    packed = BsrKernelWeight.pack(weight, (16, 32), cover_columns=cover)
    assert packed.col.numel() == packed.values.shape[0] == 4 * 3 - 1 + cover
    assert torch.equal(packed.metadata[-packed.guard.numel():], packed.guard)
    assert groups_of(packed.guard).tolist() == ([] if cover else list(range(4, 8)))
    assert set(packed.col.tolist()) == ({0, 1, 2, 3} if cover else {0, 2, 3})
    assert torch.equal(packed.to_dense(), weight)


def test_guard_after_2_4_metadata_starts_at_the_next_aligned_byte(gen):
    """A 2:4 weight's guard follows CUTLASS's metadata at the next multiple of ALIGNMENT bytes,
    the metadata unchanged, so that the GEMM finds it from the metadata's size alone."""
    for size in (37, 48, 1):
        metadata = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
        unmet = torch.zeros(64, dtype=torch.bool)
        unmet[[9, 60]] = True
        packed = nonfinite_guard.append_guard(metadata, unmet)
        start = -(-size // nonfinite_guard.ALIGNMENT) * nonfinite_guard.ALIGNMENT
        assert start % nonfinite_guard.ALIGNMENT == 0 and start >= size and packed.numel() == start + 4 * 5
        assert torch.equal(packed[:size], metadata)
        guard = nonfinite_guard.guard_after(packed, size)
        assert guard.tolist() == [0, 0, 2, 1, 7]
        assert torch.equal(nonfinite_guard.groups_of(guard), torch.tensor([1, 7], dtype=torch.int32))
