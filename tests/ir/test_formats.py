import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecc.errors import FormatError
from sparsecc.ir.formats import BSRWeight, CSRWeight, DenseWeight, FormatSpec, NMWeight, pack

from conftest import block_sparse, n_m, unstructured


@pytest.mark.parametrize("text,kind,n,m,block", [
    ("dense", "dense", 0, 0, None), ("2:4", "nm", 2, 4, None), (" 3:32 ", "nm", 3, 32, None),
    ("bsr", "bsr", 0, 0, None), ("bsr32", "bsr", 0, 0, (32, 32)), ("BSR16x64", "bsr", 0, 0, (16, 64)),
    ("csr", "csr", 0, 0, None)])
def test_parse_round_trips(text, kind, n, m, block):
    spec = FormatSpec.parse(text)
    assert (spec.kind, spec.n, spec.m, spec.block) == (kind, n, m, block)
    assert FormatSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["4:4", "0:4", "5:4", "bsr0", "coo", "2:", "", "bsr32x", 42])
def test_parse_rejects(text):
    with pytest.raises(FormatError):
        FormatSpec.parse(text)


def test_admits():
    assert FormatSpec.parse("bsr").admits(FormatSpec.parse("bsr32"))
    assert FormatSpec.parse("bsr32").admits(FormatSpec.parse("bsr32x32"))
    assert not FormatSpec.parse("bsr32").admits(FormatSpec.parse("bsr16"))
    assert not FormatSpec.parse("2:4").admits(FormatSpec.parse("2:8"))


DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 70), density=st.floats(0, 1), dtype=DTYPES,
       seed=st.integers(0, 2**31))
def test_csr_round_trip_is_exact(rows, cols, density, dtype, seed):
    w = unstructured(rows, cols, density, torch.Generator().manual_seed(seed), dtype)
    packed = pack(w, "csr")
    assert isinstance(packed, CSRWeight)
    assert torch.equal(packed.to_dense(), w)
    assert packed.values.numel() == int((w != 0).sum())
    assert packed.nbytes == packed.values.numel() * (w.element_size() + 4) + (rows + 1) * 4


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 24), cols=st.integers(1, 70), nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (4, 8), (3, 32), (5, 16)]),
       dtype=DTYPES, seed=st.integers(0, 2**31))
def test_nm_round_trip_is_exact(rows, cols, nm, dtype, seed):
    n, m = nm
    w = n_m(rows, cols, n, m, torch.Generator().manual_seed(seed), dtype)
    packed = pack(w, f"{n}:{m}")
    assert isinstance(packed, NMWeight) and packed.shape == (rows, cols)
    assert torch.equal(packed.to_dense(), w)
    groups = -(-cols // m)
    assert packed.values.shape == (rows, groups * n)
    # positions are distinct and sorted within each group
    idx = packed.indices.reshape(rows, groups, n).long()
    assert bool((idx[..., 1:] > idx[..., :-1]).all()) if n > 1 else True


def test_nm_refuses_a_weight_that_does_not_fit(gen):
    w = n_m(8, 16, 3, 4, gen)
    with pytest.raises(FormatError, match="does not fit 2:4"):
        pack(w, "2:4")


@settings(max_examples=30, deadline=None)
@given(br=st.integers(1, 4), bc=st.integers(1, 4), block=st.sampled_from([(16, 16), (32, 32), (16, 64), (64, 16), (8, 4)]),
       density=st.floats(0, 1), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_bsr_round_trip_is_exact(br, bc, block, density, dtype, seed):
    w = block_sparse(br * block[0], bc * block[1], block, density, torch.Generator().manual_seed(seed), dtype)
    packed = pack(w, FormatSpec("bsr", block=block))
    assert isinstance(packed, BSRWeight) and packed.block == block
    assert torch.equal(packed.to_dense(), w)
    present = w.reshape(br, block[0], bc, block[1]).ne(0).any(3).any(1)
    assert packed.values.shape[0] == int(present.sum())


def test_bsr_needs_divisible_shapes(gen):
    with pytest.raises(FormatError, match="does not divide"):
        pack(unstructured(30, 32, 0.5, gen), "bsr16")
    with pytest.raises(FormatError, match="needs a BSR block size"):
        pack(unstructured(32, 32, 0.5, gen), "bsr")


def test_dense_and_bad_weights(gen):
    w = unstructured(5, 7, 0.5, gen)
    assert isinstance(pack(w, "dense"), DenseWeight) and torch.equal(pack(w, "dense").to_dense(), w)
    with pytest.raises(FormatError, match="2-D"):
        pack(torch.randn(3, 4, 5), "csr")


def test_empty_and_full_weights_round_trip():
    for w in (torch.zeros(32, 64), torch.randn(32, 64) + 5):
        for spec in ("csr", "bsr16", "bsr32x16"):
            assert torch.equal(pack(w, spec).to_dense(), w)
    assert torch.equal(pack(torch.zeros(4, 8), "2:4").to_dense(), torch.zeros(4, 8))
