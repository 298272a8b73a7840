"""A sparse site packed twice by rows (sparsecc.kernels.by_rows), on any device: each call reaches
the tier its rows belong to with the packed arrays in the op's order, the dense tier computes
x W^T (fp64 reference), a sibling group shares the small call and runs its members' own weights
above, and the packing takes its format from its small tier (2:4 or blocks)."""
import pytest
import torch

import sparsecc.kernels.by_rows as by_rows
from sparsecc.ir.formats import FormatSpec
from sparsecc.kernels.bsr import BsrKernelWeight
from sparsecc.kernels.sparse24_small import Sparse24GemvWeight

from conftest import block_sparse, n_m


def _recorded_kernel_calls(monkeypatch) -> list:
    """by_rows' kernel op replaced by one that records each call's (rows, values, metadata,
    kernels) and returns zeros."""
    calls = []

    def kernel(x, values, metadata, n, k, bias, activation, x_transposed, transpose_out, kernels):
        calls.append((x.numel() // k, values, metadata, kernels))
        return x.new_zeros(*x.shape[:-1], n)

    monkeypatch.setattr(by_rows, "linear_kernel", kernel)
    return calls


def _call(packed, x, bias, activation):
    """``packed``'s op on ``x`` with its arrays and scalars in the op's order, as a site calls it."""
    return packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, activation, False, False,
                     *packed.extra_args)


def _packed(gen, dense_above: bool):
    weight = n_m(48, 64, 2, 4, gen)
    small = Sparse24GemvWeight.pack(weight).running([])
    large = None if dense_above else Sparse24GemvWeight(weight[:, ::2].clone(), None, 48, 64, kernels="large table")
    return weight, by_rows.ByRowsWeight(small, 4, large, weight if dense_above else None)


@pytest.mark.parametrize("dense_above", [False, True])
def test_each_call_runs_the_tier_of_its_rows(monkeypatch, gen, dense_above):
    weight, packed = _packed(gen, dense_above)
    calls = _recorded_kernel_calls(monkeypatch)
    bias = torch.randn(48, generator=gen)
    for rows in (1, 4, 5, 300):
        x = torch.randn(rows, 64, generator=gen)
        got = _call(packed, x, bias, "relu")
        assert got.shape == (rows, 48)
        if rows <= 4:
            assert calls[-1][0] == rows and calls[-1][1] is packed.small.values and calls[-1][3] == packed.small.kernels
        elif dense_above:
            want = torch.relu(x.double() @ weight.double().t() + bias.double())
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5) and calls[-1][0] <= 4
        else:
            assert calls[-1][0] == rows and calls[-1][1] is packed.large.values and calls[-1][3] == "large table"
    assert packed.shape == (48, 64) and torch.equal(packed.to_dense(), weight)
    extra = weight.numel() * 4 if dense_above else packed.large.values.numel() * 4
    assert packed.nbytes == packed.small.nbytes + extra


def _group(gen, sizes=(48, 16, 16)):
    """Three members' weights and their group's packing: the stacked weight's small tier up to 4
    rows, the members' own weights above."""
    weights = [n_m(n, 64, 2, 4, gen) for n in sizes]
    stacked = by_rows.ByRowsWeight(Sparse24GemvWeight.pack(torch.cat(weights)).running([]), 4, None, torch.cat(weights))
    return weights, stacked.for_members(weights)


def test_a_group_shares_the_small_call_and_runs_each_members_weight_above(monkeypatch, gen):
    weights, packed = _group(gen)
    calls = []

    def kernel(x, values, metadata, n, k, bias, activation, x_transposed, transpose_out, kernels):
        calls.append((x.numel() // k, values, n))
        return torch.relu(x.double() @ packed.small.to_dense().double().t() + bias.double()).to(x.dtype)

    monkeypatch.setattr(by_rows, "linear_kernel", kernel)
    bias = torch.randn(80, generator=gen)
    for rows in (1, 4, 5, 300):
        x = torch.randn(rows, 64, generator=gen)
        got = _call(packed, x, bias, "relu")
        assert [tuple(y.shape) for y in got] == [(rows, 48), (rows, 16), (rows, 16)]
        for y, w, b in zip(got, weights, bias.split([48, 16, 16])):
            want = torch.relu(x.double() @ w.double().t() + b.double())
            assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5), rows
        if rows <= 4:
            assert calls[-1] == (rows, packed.small.values, 80) and len(calls) == [1, 4].index(rows) + 1
        else:
            assert len(calls) == 2                        # the members' own weights: no kernel call
    assert all(mine is theirs for mine, theirs in zip(packed.tensors()["dense"], weights))     # no stacked copy
    assert packed.shape == (80, 64) and torch.equal(packed.to_dense(), torch.cat(weights))
    assert packed.nbytes == packed.small.nbytes + sum(w.numel() * 4 for w in weights)


def test_only_a_packing_whose_top_runs_dense_takes_the_members_weights(gen):
    weights, packed = _group(gen)
    with pytest.raises(ValueError, match="48 rows, the stacked one 80"):
        by_rows.ByRowsWeight(packed.small, 4, None, torch.cat(weights)).for_members(weights[:1])
    with pytest.raises(ValueError, match="top runs dense"):
        by_rows.ByRowsWeight(packed.small, 4, packed.small, None).for_members(weights)


def test_a_block_sparse_small_tier_runs_up_to_its_limit_and_dense_above(monkeypatch, gen):
    """A BSR packing below 16 rows, the dense weight above: the packing is a bsr64x64 weight of the
    model's shape, unpacks to the weight, and calls past 16 rows compute x W^T from the dense one."""
    weight = block_sparse(128, 192, (64, 64), 0.5, gen)
    small = BsrKernelWeight.pack(weight, (64, 64)).running([])
    packed = by_rows.ByRowsWeight(small, 16, None, weight)
    assert packed.spec == FormatSpec.parse("bsr64x64") and packed.shape == (128, 192)
    assert torch.equal(packed.to_dense(), weight)
    calls = _recorded_kernel_calls(monkeypatch)
    bias = torch.randn(128, generator=gen)
    for rows in (1, 16, 17, 512):
        x = torch.randn(rows, 192, generator=gen)
        got = _call(packed, x, bias, "gelu")
        if rows <= 16:
            assert calls[-1][0] == rows and calls[-1][1] is small.values and calls[-1][2] is small.metadata
        else:
            want = torch.nn.functional.gelu(x.double() @ weight.double().t() + bias.double())
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5) and len(calls) == 2
