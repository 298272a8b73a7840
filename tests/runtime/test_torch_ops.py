"""The custom ops against an fp64 reference, on every format, dtype and layout flag."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from sparsecc.errors import InputError
from sparsecc.ir.epilogue import apply_activation
from sparsecc.ir.formats import FormatSpec, pack
from sparsecc.runtime.torch_ops import OP_FOR_KIND

from conftest import assert_rel_close, block_sparse, n_m, unstructured

ACTIVATIONS = ["none", "relu", "gelu", "gelu_tanh", "silu"]


def reference(x, w, bias, activation, x_transposed, transpose_out):
    """fp64 reference of y = act(x' W^T + b), with the layout flags."""
    x64 = x.double()
    if x_transposed and x.dim() > 1:
        x64 = x64.transpose(-1, -2)
    y = F.linear(x64, w.double(), None if bias is None else bias.double())
    y = apply_activation(y, activation)
    return y.transpose(-1, -2) if transpose_out and y.dim() > 1 else y


def run_op(packed, x, bias, activation, x_transposed, transpose_out):
    op = OP_FOR_KIND[packed.spec.kind]
    return op(x, *packed.tensors().values(), *packed.scalars().values(), bias, activation, x_transposed, transpose_out)


def weight_for(spec: FormatSpec, rows, cols, gen, dtype):
    if spec.kind == "nm":
        return n_m(rows, cols, spec.n, spec.m, gen, dtype)
    if spec.kind == "bsr":
        return block_sparse(rows, cols, spec.block, 0.4, gen, dtype)
    return unstructured(rows, cols, 0.3, gen, dtype)


SPECS = ["dense", "2:4", "3:8", "bsr16", "bsr16x32", "csr"]


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       activation=st.sampled_from(ACTIVATIONS), x_transposed=st.booleans(), transpose_out=st.booleans(),
       lead=st.sampled_from([(), (3,), (2, 3)]), m=st.integers(1, 9), blocks=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       with_bias=st.booleans(), seed=st.integers(0, 2**31))
def test_ops_match_fp64_reference(spec, dtype, activation, x_transposed, transpose_out, lead, m, blocks, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    spec = FormatSpec.parse(spec)
    rows, cols = blocks[0] * 32, blocks[1] * 32 + (0 if spec.kind == "bsr" else 5)
    w = weight_for(spec, rows, cols, gen, dtype)
    x = torch.randn(*lead, cols, m, generator=gen).to(dtype) if x_transposed else torch.randn(*lead, m, cols, generator=gen).to(dtype)
    bias = torch.randn(rows, generator=gen).to(dtype) if with_bias else None
    got = run_op(pack(w, spec), x, bias, activation, x_transposed, transpose_out)
    ref = reference(x, w, bias, activation, x_transposed, transpose_out)
    assert got.dtype == dtype and got.is_contiguous()
    assert_rel_close(got, ref, dtype)


def test_one_dimensional_input(gen):
    for spec in SPECS[:2] + SPECS[3:4] + ["csr"]:
        w_spec = weight_for(FormatSpec.parse(spec), 32, 40 if spec != "bsr16" else 32, gen, torch.float32)
        x = torch.randn(w_spec.shape[1], generator=gen)
        for x_t in (False, True):
            got = run_op(pack(w_spec, spec), x, None, "relu", x_t, x_t)
            assert got.shape == (32,)
            assert_rel_close(got, torch.relu(w_spec.double() @ x.double()), torch.float32)


@pytest.mark.parametrize("spec", SPECS)
def test_opcheck(spec, gen):
    spec = FormatSpec.parse(spec)
    w = weight_for(spec, 32, 64, gen, torch.float32)
    packed = pack(w, spec)
    x = torch.randn(2, 5, 64, generator=gen)
    args = (x, *packed.tensors().values(), *packed.scalars().values(), torch.randn(32, generator=gen), "gelu", False, True)
    torch.library.opcheck(OP_FOR_KIND[spec.kind], args)


def test_fake_shapes_match_real(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    w = unstructured(32, 48, 0.2, gen)
    packed = pack(w, "csr")
    x = torch.randn(4, 48, 7, generator=gen)
    real = run_op(packed, x, None, "none", True, False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = run_op(packed, torch.empty(4, 48, 7), None, "none", True, False)
    assert tuple(fake.shape) == tuple(real.shape) == (4, 7, 32)


def test_bad_inputs_raise_clear_errors(gen):
    packed = pack(unstructured(16, 32, 0.3, gen), "csr")
    with pytest.raises(InputError, match="features along K"):
        run_op(packed, torch.randn(3, 31), None, "none", False, False)
    with pytest.raises(InputError, match="dtype"):
        run_op(packed, torch.randn(3, 32, dtype=torch.float64), None, "none", False, False)
    with pytest.raises(InputError, match="activation"):
        run_op(packed, torch.randn(3, 32), None, "tanh", False, False)
