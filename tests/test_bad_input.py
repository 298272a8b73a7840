"""Bad and unusual inputs at the CPU ops (all four families): each gives the right result or
a clear InputError (a SparseccError), never a crash or wrong numbers. The CUDA kernel op
gets the same treatment in tests/test_bad_input_gpu.py."""
import re

import pytest
import torch

from sparsecc.ir.epilogue import apply_activation
from sparsecc.errors import InputError, SparseccError
from sparsecc.ir.formats import FormatSpec, pack

from conftest import assert_rel_close
from test_fuzz import make_input
from runtime.test_torch_ops import reference, run_op, weight_for

#: every family; BSR both square (torch's kernel for fp32/fp64) and not (block products)
SPECS = ["dense", "2:4", "bsr16", "bsr16x32", "csr"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
N, K = 32, 64


def packed_weight(spec: str, gen, dtype=torch.float32):
    """A random weight of ``spec`` ([N, K], non-zero where kept) and its packed form."""
    w = weight_for(FormatSpec.parse(spec), N, K, gen, dtype)
    return w, pack(w, spec)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("x_dtype", [torch.float64, torch.float16, torch.int32])
def test_wrong_input_dtype_raises(spec, x_dtype, gen):
    _, packed = packed_weight(spec, gen)
    x = torch.randn(3, K, generator=gen).to(x_dtype)
    with pytest.raises(InputError, match=rf"input dtype {x_dtype} does not match the weight's torch.float32") as info:
        run_op(packed, x, None, "none", False, False)
    assert isinstance(info.value, SparseccError)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape, x_transposed", [((3, K + 1), False), ((2, 3, K - 16), False),
                                                 ((K + 16, 3), True), ((K // 2,), False)])
def test_feature_mismatch_names_both_sizes(spec, shape, x_transposed, gen):
    _, packed = packed_weight(spec, gen)
    x = torch.randn(*shape, generator=gen)
    given = shape[-2] if x_transposed else shape[-1]
    with pytest.raises(InputError, match=rf"input has {given} features along K, the weight expects {K}\b"):
        run_op(packed, x, None, "none", x_transposed, False)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bias_shape", [(N - 1,), (N + 1,), (1,), (1, N), ()])
def test_bias_of_the_wrong_shape_raises(spec, bias_shape, gen):
    """Never broadcast: a [1] or [1, N] bias is refused like one of the wrong length."""
    _, packed = packed_weight(spec, gen)
    x = torch.randn(3, K, generator=gen)
    bias = torch.randn(bias_shape, generator=gen)
    with pytest.raises(InputError, match=rf"bias has shape {re.escape(str(tuple(bias_shape)))}.*\({N},\)"):
        run_op(packed, x, bias, "none", False, False)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype, bias_dtype", [(torch.float32, torch.float64), (torch.float32, torch.float16),
                                               (torch.float16, torch.float32), (torch.bfloat16, torch.float64)])
def test_bias_of_another_dtype_is_cast(spec, dtype, bias_dtype, gen):
    """A bias of another dtype is cast to the input's, exactly as if it had come in that dtype."""
    w, packed = packed_weight(spec, gen, dtype)
    x = torch.randn(4, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(bias_dtype)
    got = run_op(packed, x, bias, "gelu", False, False)
    assert got.dtype == dtype
    assert torch.equal(got, run_op(packed, x, bias.to(dtype), "gelu", False, False))
    assert_rel_close(got, reference(x, w, bias.to(dtype), "gelu", False, False), dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["transposed", "strided", "offset"])
@pytest.mark.parametrize("x_transposed", [False, True])
def test_noncontiguous_and_misaligned_inputs(spec, dtype, layout, x_transposed, gen):
    """A transposed view, a step slice (NaN in its gaps) and a view one element past an
    aligned start (NaN before it) all give the fp64 reference's numbers."""
    w, packed = packed_weight(spec, gen, dtype)
    shape = (2, K, 5) if x_transposed else (2, 5, K)
    x = make_input(shape, dtype, layout, gen)
    assert not x.is_contiguous() if layout != "offset" else x.data_ptr() % 16
    bias = torch.randn(N, generator=gen).to(dtype)
    got = run_op(packed, x, bias, "silu", x_transposed, False)
    assert_rel_close(got, reference(x, w, bias, "silu", x_transposed, False), dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, x_transposed, transpose_out, expected", [
    ((0, K), False, False, (0, N)), ((2, 0, K), False, False, (2, 0, N)),
    ((0, K), False, True, (N, 0)), ((2, 0, K), False, True, (2, N, 0)),
    ((K, 0), True, False, (0, N)), ((0, K, 3), True, True, (0, N, 3))])
def test_empty_batch(spec, dtype, shape, x_transposed, transpose_out, expected, gen):
    _, packed = packed_weight(spec, gen, dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    got = run_op(packed, x, bias, "relu", x_transposed, transpose_out)
    assert tuple(got.shape) == expected and got.dtype == dtype


def ieee_reference(x, w, bias, activation):
    """fp64 ``act(x W^T + b)`` as elementwise products and a sum: IEEE semantics throughout
    (``0 * NaN = NaN``, ``0 * Inf = NaN``), whatever a BLAS might skip."""
    y = (x.double().unsqueeze(-2) * w.double()).sum(-1)
    return apply_activation(y if bias is None else y + bias.double(), activation)


def scattered_nonfinite(rows: int, k: int, gen) -> torch.Tensor:
    """x [rows, k] (fp32, CPU) with one NaN, +Inf or -Inf in each row at a random place (+Inf in
    the first row), and in the second row a second infinity of the other sign: an infinity gives
    NaN against a zero and an infinity against a value, so the outputs show which row and group
    of a weight's metadata a kernel read."""
    x = torch.randn(rows, k, generator=gen)
    kinds = torch.tensor([float("inf"), -float("inf"), float("nan")])[torch.randint(0, 3, (rows,), generator=gen)]
    kinds[0] = float("inf")
    columns = torch.randint(0, k, (rows,), generator=gen)
    x[torch.arange(rows), columns] = kinds
    if rows > 1:
        x[1, (columns[1] + 5) % k] = -x[1, columns[1]]
    return x


def assert_same_nonfinite(got, ref, dtype):
    """NaN, +Inf and -Inf at the same positions, and the finite rest within tolerance."""
    assert torch.equal(got.isnan(), ref.isnan()), "NaN positions differ"
    assert torch.equal(got.isposinf(), ref.isposinf()), "+Inf positions differ"
    assert torch.equal(got.isneginf(), ref.isneginf()), "-Inf positions differ"
    finite = ref.isfinite()
    assert_rel_close(got[finite], ref[finite], dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_nan_and_inf_propagate_like_dense(spec, dtype, activation, gen):
    """NaN and infinities meet the weight's zeros exactly as in dense F.linear: a NaN where a
    whole column of W is zero still makes its row NaN, an Inf gives NaN against a zero and
    +/-Inf against a value. Rows without them are untouched."""
    spec_ = FormatSpec.parse(spec)
    w = weight_for(spec_, N, K, gen, dtype)
    zero_cols = spec_.block[1] if spec_.kind == "bsr" else 16
    w[:, :zero_cols] = 0                     # a block column of zeros: nothing stored there
    packed = pack(w, spec)
    assert torch.equal(packed.to_dense(), w)
    x = torch.randn(6, K, generator=gen).to(dtype)
    x[0, 3] = float("nan")                  # meets only zeros
    x[1, zero_cols + 5] = float("nan")      # meets values and zeros
    x[2, zero_cols + 1] = float("inf")
    x[3, zero_cols + 2] = -float("inf")
    x[4, 7] = float("inf")                  # meets only zeros: NaN in the whole row
    bias = torch.randn(N, generator=gen).to(dtype)
    for xt in (False, True):
        operand = x.t().contiguous() if xt else x
        got = run_op(packed, operand, bias, activation, xt, False)
        ref = ieee_reference(x, w, bias, activation)
        assert_same_nonfinite(got, ref, dtype)
    assert ref[[0, 1, 4]].isnan().all() and ref[5].isfinite().all()
    assert torch.equal(ref.isnan(), reference(x, w, bias, activation, False, False).isnan())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("activation", ["tanh", "", "RELU", "gelu "])
def test_unknown_activation_raises(spec, activation, gen):
    _, packed = packed_weight(spec, gen)
    with pytest.raises(InputError, match=rf"unknown activation {activation!r}"):
        run_op(packed, torch.randn(3, K, generator=gen), None, activation, False, False)
