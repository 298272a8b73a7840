"""Every mask satisfies its pattern exactly, and keeps the most score it can.

Ties: scores are compared exactly, lower index wins. Brute-force comparisons are made on
the total score kept (over all C(m, n) subsets for m <= 8); the tie rule itself is checked
against a stable sort (largest score first, lower index first among equals).
"""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecc.ir.analysis import analyze
from sparsecc.errors import InputError, PatternError
from sparsecc.ir.formats import FormatSpec
from sparsecc.pruning import masks, topn
from sparsecc.pruning.masks import (block_masks, block_nm_mask, kept_count, nm_mask, pattern_mask,
                                    pattern_masks, unstructured_masks, vector_nm_mask)
from sparsecc.pruning.patterns import parse_pattern
from sparsecc.pruning.topn import TopN

from conftest import nonzero_randn


def weight(rows, cols, seed, ties):
    """Random data, never zeros; with ``ties`` the values are small integers (+-1..+-3), so
    equal magnitudes are everywhere and the tie rule decides."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        return (torch.randint(1, 4, (rows, cols), generator=g)
                * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)).float()
    return nonzero_randn(rows, cols, generator=g)


def tie_rule_choice(scores, n):
    """The n positions the tie rule keeps: largest first, lower index first among equals."""
    return set(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n])


def best_total(scores, n):
    """Brute force: the largest total over all subsets of n positions."""
    return max(sum(subset) for subset in itertools.combinations(scores, min(n, len(scores))))


def groups_of(row, m):
    return [row[start:start + m] for start in range(0, len(row), m)]


small_nm = st.integers(2, 8).flatmap(lambda m: st.tuples(st.integers(1, m - 1), st.just(m)))
any_nm = st.integers(2, 40).flatmap(lambda m: st.tuples(st.integers(1, m - 1), st.just(m)))


@settings(max_examples=120, deadline=None)
@given(nm=small_nm, rows=st.integers(1, 5), cols=st.integers(1, 30), seed=st.integers(0, 2**31),
       ties=st.booleans())
def test_nm_is_exact_and_optimal_against_brute_force(nm, rows, cols, seed, ties):
    n, m = nm
    w = weight(rows, cols, seed, ties)
    mask = nm_mask(w, n, m)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    for row, kept in zip(w.abs().tolist(), mask.tolist()):
        for scores, keep in zip(groups_of(row, m), groups_of(kept, m)):
            chosen = {i for i, k in enumerate(keep) if k}
            assert len(chosen) == min(n, len(scores))            # exactly n (last group: <= n)
            assert math.isclose(sum(scores[i] for i in chosen), best_total(scores, n), rel_tol=1e-6)
            assert chosen == tie_rule_choice(scores, n)
    pruned = w * mask
    if cols >= m:
        assert analyze(pruned, extra_group_sizes=(m,)).fits(FormatSpec("nm", n=n, m=m))


@settings(max_examples=60, deadline=None)
@given(nm=any_nm, rows=st.integers(1, 6), cols=st.integers(1, 100), seed=st.integers(0, 2**31),
       ties=st.booleans(), chunk=st.sampled_from([1, 7, 64, 1 << 20]))
def test_nm_any_m_keeps_the_top_n_of_every_group(nm, rows, cols, seed, ties, chunk):
    """Covers both threshold algorithms (tournament, topk), padding and chunking."""
    n, m = nm
    w = weight(rows, cols, seed, ties)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masks, "CHUNK_ELEMENTS", chunk)
        mask = nm_mask(w, n, m)
    for row, kept in zip(w.abs().tolist(), mask.tolist()):
        for scores, keep in zip(groups_of(row, m), groups_of(kept, m)):
            chosen = {i for i, k in enumerate(keep) if k}
            assert chosen == tie_rule_choice(scores, n)
    if cols >= m:
        assert analyze(w * mask, extra_group_sizes=(m,)).fits(FormatSpec("nm", n=n, m=m))
        assert not analyze(w * mask, extra_group_sizes=(m,)).fits(FormatSpec("nm", n=n - 1, m=m)) \
            if n > 1 else True


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 4), (4, 8), (7, 8), (3, 32), (16, 32), (5, 9)])
def test_top_n_exact_on_repeated_values(n, m):
    """Rows full of duplicates all take the tie-breaking path."""
    g = torch.Generator().manual_seed(n * 100 + m)
    groups = torch.randint(0, 3, (200, m), generator=g).float()
    keep = TopN(n, m, 200, torch.float32)(groups)
    assert (keep.sum(-1) == n).all()
    for scores, kept in zip(groups.tolist(), keep.tolist()):
        assert {i for i, k in enumerate(kept) if k} == tie_rule_choice(scores, n)


@pytest.mark.parametrize("n, m", [(1, 2), (2, 4), (1, 4), (3, 4), (4, 8), (2, 8), (3, 32), (4, 32),
                                  (29, 32), (16, 32), (5, 9), (2, 3), (3, 12)])
def test_distinct_scores_never_need_the_tie_fallback(n, m, monkeypatch):
    """The tournament alone must find the threshold; the stable-sort fallback is for ties."""
    redone = []
    original = topn._redo_tied_groups
    monkeypatch.setattr(topn, "_redo_tied_groups",
                        lambda groups, keep, n: redone.append(1) or original(groups, keep, n))
    g = torch.Generator().manual_seed(n * 1000 + m)
    scores = torch.randperm(40 * (3 * m - 1), generator=g).float().reshape(40, 3 * m - 1)  # padded
    mask = nm_mask(scores, n, m, magnitude=False)
    assert not redone
    for row, kept in zip(scores.tolist(), mask.tolist()):
        for group, keep in zip(groups_of(row, m), groups_of(kept, m)):
            assert {i for i, k in enumerate(keep) if k} == tie_rule_choice(group, n)


def test_nm_with_custom_scores_never_keeps_padding():
    """Negative scores (magnitude=False) still beat the zero-padding of a short last group."""
    scores = -torch.arange(1.0, 11.0).repeat(3, 1)                   # K = 10, m = 4: last group of 2
    mask = nm_mask(scores, 3, 4, magnitude=False)
    assert mask[:, 8:].all()                                         # both real positions kept
    assert (mask.sum(1) == 3 + 3 + 2).all()
    assert mask[:, 0:3].all() and not mask[:, 3].any()              # least negative first


def test_nm_does_not_modify_its_input():
    w = nonzero_randn(8, 12, generator=torch.Generator().manual_seed(0))
    before = w.clone()
    nm_mask(w, 2, 4)
    nm_mask(w, 2, 5, magnitude=False)
    assert torch.equal(w, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_nm_low_precision_matches_float32(dtype):
    w = nonzero_randn(16, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    for n, m in [(2, 4), (3, 32)]:
        assert torch.equal(nm_mask(w, n, m), nm_mask(w.float(), n, m))


def test_nm_handles_a_transposed_view():
    w = nonzero_randn(12, 20, generator=torch.Generator().manual_seed(2))
    assert torch.equal(nm_mask(w.t(), 2, 4), nm_mask(w.t().contiguous(), 2, 4))


@settings(max_examples=50, deadline=None)
@given(nm=small_nm, v=st.integers(1, 5), rows=st.integers(1, 11), cols=st.integers(1, 20),
       seed=st.integers(0, 2**31), ties=st.booleans())
def test_vector_nm_shares_positions_and_is_optimal(nm, v, rows, cols, seed, ties):
    n, m = nm
    w = weight(rows, cols, seed, ties)
    mask = vector_nm_mask(w, n, m, v)
    for start in range(0, rows, v):
        vector = mask[start:start + v]
        assert (vector == vector[0]).all()                      # one pattern per vector
        summed = w[start:start + v].abs().sum(0).tolist()       # the last vector may be shorter
        for scores, keep in zip(groups_of(summed, m), groups_of(vector[0].tolist(), m)):
            chosen = {i for i, k in enumerate(keep) if k}
            assert len(chosen) == min(n, len(scores))
            assert math.isclose(sum(scores[i] for i in chosen), best_total(scores, n), rel_tol=1e-5)
    if cols >= m:
        assert analyze(w * mask, extra_group_sizes=(m,)).fits(FormatSpec("nm", n=n, m=m))


@settings(max_examples=40, deadline=None)
@given(nm=st.integers(2, 6).flatmap(lambda m: st.tuples(st.integers(1, m - 1), st.just(m))),
       b=st.integers(1, 4), block_rows=st.integers(1, 4), block_cols=st.integers(1, 13),
       seed=st.integers(0, 2**31), ties=st.booleans())
def test_block_nm_keeps_whole_blocks_optimally(nm, b, block_rows, block_cols, seed, ties):
    n, m = nm
    w = weight(block_rows * b, block_cols * b, seed, ties)
    mask = block_nm_mask(w, n, m, b)
    blocks = mask.reshape(block_rows, b, block_cols, b)
    block_keep = blocks[:, 0, :, 0]
    assert (blocks == block_keep[:, None, :, None]).all()          # whole blocks only
    l1 = w.abs().reshape(block_rows, b, block_cols, b).sum((1, 3))
    for scores, kept in zip(l1.tolist(), block_keep.tolist()):
        for group, keep in zip(groups_of(scores, m), groups_of(kept, m)):
            chosen = {i for i, k in enumerate(keep) if k}
            assert len(chosen) == min(n, len(group))
            assert math.isclose(sum(group[i] for i in chosen), best_total(group, n), rel_tol=1e-5)
    kept_per_strip = sum(min(n, len(group)) for group in groups_of(list(range(block_cols)), m))
    stats = analyze(w * mask, extra_blocks=((b, b),))
    assert stats.block_density[(b, b)] == pytest.approx(kept_per_strip / block_cols)
    if block_cols % m == 0:
        assert stats.block_density[(b, b)] == pytest.approx(n / m)


def test_block_nm_refuses_shapes_the_block_does_not_divide():
    with pytest.raises(PatternError, match="multiple of 32"):
        block_nm_mask(torch.ones(10, 64), 2, 4, 32)


@settings(max_examples=50, deadline=None)
@given(h=st.integers(1, 4), w=st.integers(1, 4), block_rows=st.integers(1, 6),
       block_cols=st.integers(1, 6), density=st.floats(0.01, 1.0), seed=st.integers(0, 2**31),
       ties=st.booleans())
def test_block_keeps_exactly_the_rounded_count_of_the_heaviest_blocks(h, w, block_rows, block_cols,
                                                                     density, seed, ties):
    x = weight(block_rows * h, block_cols * w, seed, ties)
    (mask,) = block_masks([x], h, w, density)
    blocks = mask.reshape(block_rows, h, block_cols, w)
    block_keep = blocks[:, 0, :, 0]
    assert (blocks == block_keep[:, None, :, None]).all()
    units = block_rows * block_cols
    assert int(block_keep.sum()) == kept_count(density, units)
    l1 = x.abs().reshape(block_rows, h, block_cols, w).sum((1, 3)).flatten().tolist()
    assert {i for i, k in enumerate(block_keep.flatten().tolist()) if k} == \
        tie_rule_choice(l1, kept_count(density, units))
    stats = analyze(x * mask, extra_blocks=((h, w),))
    assert stats.block_density[(h, w)] == pytest.approx(kept_count(density, units) / units)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 12), density=st.floats(0.001, 1.0),
       seed=st.integers(0, 2**31), ties=st.booleans())
def test_unstructured_keeps_exactly_the_rounded_count_of_the_largest(rows, cols, density, seed, ties):
    w = weight(rows, cols, seed, ties)
    (mask,) = unstructured_masks([w], density)
    kept = kept_count(density, w.numel())
    assert int(mask.sum()) == kept
    assert {i for i, k in enumerate(mask.flatten().tolist()) if k} == \
        tie_rule_choice(w.abs().flatten().tolist(), kept)
    assert analyze(w * mask).nnz == kept


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=4),
       density=st.floats(0.01, 1.0), seed=st.integers(0, 2**31), ties=st.booleans())
def test_global_unstructured_uses_one_threshold_across_weights(shapes, density, seed, ties):
    weights = [weight(r, c, seed + i, ties) for i, (r, c) in enumerate(shapes)]
    masks_ = pattern_masks(parse_pattern(f"unstructured@{density!r}"), weights, scope="global")
    flat = torch.cat([w.abs().flatten() for w in weights]).tolist()
    kept = kept_count(density, len(flat))
    chosen = torch.cat([m.flatten() for m in masks_]).tolist()
    assert {i for i, k in enumerate(chosen) if k} == tie_rule_choice(flat, kept)


def test_global_block_ranks_blocks_of_all_weights_together():
    g = torch.Generator().manual_seed(3)
    small, large = nonzero_randn(8, 8, generator=g) * 0.01, nonzero_randn(8, 16, generator=g)
    small_mask, large_mask = block_masks([small, large], 4, 4, 0.5)
    assert not small_mask.any()                                       # all 12 kept come from `large`
    assert int(large_mask.sum()) == kept_count(0.5, 4 + 8) * 16
    per_layer = pattern_masks(parse_pattern("block4x4@0.5"), [small, large], scope="layer")
    assert int(per_layer[0].sum()) == 2 * 16 and int(per_layer[1].sum()) == 4 * 16


@pytest.mark.parametrize("density, units, expected", [
    (0.5, 3, 2), (0.5, 5, 3), (0.1, 5, 1), (0.3, 5, 2), (0.01, 10, 1), (1.0, 7, 7), (0.25, 0, 0),
    (0.1, 1000, 100), (0.05, 30, 2)])
def test_kept_count_rounds_half_up_and_keeps_at_least_one(density, units, expected):
    assert kept_count(density, units) == expected


@settings(max_examples=200, deadline=None)
@given(density=st.floats(1e-6, 1.0), units=st.integers(1, 10**7))
def test_kept_count_is_within_half_a_unit(density, units):
    kept = kept_count(density, units)
    assert 1 <= kept <= units
    assert abs(kept - density * units) <= 0.5 + 1e-9 or kept == 1


@pytest.mark.parametrize("pattern", ["2:4", "3:32", "2:4/vw4", "2:4/bw4", "block4x4@0.5",
                                     "unstructured@0.3"])
def test_nan_scores_are_refused(pattern):
    w = nonzero_randn(8, 32, generator=torch.Generator().manual_seed(4))
    w[3, 5] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        pattern_mask(pattern, w)


@pytest.mark.parametrize("bad", [torch.ones(4), torch.ones(2, 4, 4), "weights"])
def test_non_matrix_weights_are_refused(bad):
    with pytest.raises(InputError, match="2-D"):
        nm_mask(bad, 2, 4)
    with pytest.raises(InputError, match="2-D"):
        unstructured_masks([bad], 0.5)


def test_scores_are_used_as_given_without_magnitude():
    g = torch.Generator().manual_seed(5)
    w = nonzero_randn(6, 16, generator=g)
    shifted = w - w.min() + 1                          # positive, same order as w
    assert torch.equal(nm_mask(w, 2, 4, magnitude=False), nm_mask(shifted, 2, 4))
    assert not torch.equal(nm_mask(w, 2, 4, magnitude=False), nm_mask(w, 2, 4))
    assert torch.equal(unstructured_masks([w], 0.25, magnitude=False)[0],
                       unstructured_masks([w - w.min() + 1], 0.25)[0])


def test_integer_scores_are_compared_exactly():
    scores = torch.tensor([[3, 1, 2, 2, 7, 7, 7, 0]])
    assert nm_mask(scores, 2, 4, magnitude=False).tolist() == \
        [[True, False, True, False, True, True, False, False]]


def test_group_patterns_refuse_global_scope_and_bad_scopes():
    w = torch.ones(4, 8)
    with pytest.raises(InputError, match="scope='layer'"):
        pattern_masks(parse_pattern("2:4"), [w], scope="global")
    with pytest.raises(InputError, match="'layer' or 'global'"):
        pattern_masks(parse_pattern("unstructured@0.5"), [w], scope="model")


def test_empty_weights_give_empty_masks():
    assert nm_mask(torch.ones(0, 8), 2, 4).shape == (0, 8)
    assert nm_mask(torch.ones(3, 0), 2, 4).shape == (3, 0)
