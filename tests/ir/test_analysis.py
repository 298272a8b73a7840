import itertools

import torch
from hypothesis import given, settings, strategies as st

from sparsecc.ir.analysis import analyze
from sparsecc.ir.formats import FormatSpec

from conftest import block_sparse, n_m, unstructured


def brute_min_n(w, m):
    """Max non-zeros over groups of m along K, the last group zero-padded (definition)."""
    rows, cols = w.shape
    worst = 0
    for r in range(rows):
        for start in range(0, cols, m):
            worst = max(worst, int((w[r, start:start + m] != 0).sum()))
    return worst


def brute_beyond_24(w):
    """Non-zeros beyond two in each group of four along K, the last group zero-padded (definition)."""
    rows, cols = w.shape
    return sum(max(0, int((w[r, start:start + 4] != 0).sum()) - 2) for r in range(rows) for start in range(0, cols, 4))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(4, 40), density=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_nm_min_n_and_the_residual_beyond_24_match_the_definition(rows, cols, density, seed):
    w = unstructured(rows, cols, density, torch.Generator().manual_seed(seed))
    stats = analyze(w)
    for m, n in stats.nm_min_n.items():
        assert n == brute_min_n(w, m)
    assert stats.beyond_24 == brute_beyond_24(w)
    assert stats.nnz == int((w != 0).sum())
    assert abs(stats.density - stats.nnz / w.numel()) < 1e-12


def test_fits_follows_the_pattern(gen):
    w = n_m(16, 64, 2, 4, gen)
    stats = analyze(w)
    assert stats.fits(FormatSpec.parse("2:4")) and stats.fits(FormatSpec.parse("4:8"))
    assert not stats.fits(FormatSpec.parse("1:4"))
    assert "2:4" in stats.fitting_patterns()
    assert stats.fits(FormatSpec.parse("csr")) and stats.fits(FormatSpec.parse("dense"))


def test_block_density_counts_non_zero_blocks(gen):
    w = block_sparse(64, 128, (32, 32), 0.3, gen)
    stats = analyze(w)
    for (h, bw), density in stats.block_density.items():
        blocks = [(i, j) for i, j in itertools.product(range(64 // h), range(128 // bw))]
        nonzero = sum(bool((w[i * h:(i + 1) * h, j * bw:(j + 1) * bw] != 0).any()) for i, j in blocks)
        assert abs(density - nonzero / len(blocks)) < 1e-12
    assert stats.fits(FormatSpec.parse("bsr32")) and not stats.fits(FormatSpec.parse("bsr24"))


def test_extra_groups_and_blocks_are_measured(gen):
    w = unstructured(48, 96, 0.2, gen)
    stats = analyze(w, extra_group_sizes=(12,), extra_blocks=((24, 48),))
    assert 12 in stats.nm_min_n and (24, 48) in stats.block_density
