"""Fuzzing the custom ops: thousands of random cases (formats, dtypes, shapes, densities,
epilogues, layout flags, leading batch dims and strides) against an fp64 reference.

The harness is reusable for any implementation of the ops: :func:`cases` (the strategy),
:func:`check_case` (make one case's tensors, pack, run, compare; the op and the packing
are arguments), :func:`fuzz` (run a number of cases with a fixed seed, count what they
covered) and :func:`assert_covered`. tests/test_fuzz_gpu.py runs the same harness on the
CUDA kernels.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sparsecc.ir.formats import FormatSpec, PackedWeight, pack

from conftest import TOLERANCE, block_sparse, n_m, nonzero_randn, unstructured
from runtime.test_torch_ops import ACTIVATIONS, reference, run_op

#: how ``x`` lies in memory: as is, a transposed view, every other element of a wider
#: tensor (a step slice), or one element past an aligned start (data_ptr not 16-byte aligned)
LAYOUTS = ("contiguous", "transposed", "strided", "offset")

CPU_FORMATS = ("dense", "1:2", "1:4", "2:4", "2:8", "3:8", "bsr16", "bsr32", "bsr16x32",
               "bsr32x16", "csr")
CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CPU_EXAMPLES = 2000

#: what runs a packed weight: (packed, x, bias, activation, x_transposed, transpose_out) -> y
RunOp = Callable[[PackedWeight, torch.Tensor, Optional[torch.Tensor], str, bool, bool], torch.Tensor]
#: what packs a dense [N, K] weight for the op under test: (weight, format) -> packed
PackFn = Callable[[torch.Tensor, str], PackedWeight]


@dataclass(frozen=True)
class Case:
    """One drawn case; its tensors are made from ``seed`` by :func:`make_tensors`."""

    fmt: str
    dtype: torch.dtype
    out_features: int
    in_features: int
    x_shape: tuple[int, ...]   # the logical x: [..., K], or [..., K, M] with x_transposed
    layout: str                # one of LAYOUTS
    density: float             # share of weights kept; 0.0 is the deliberate empty weight
    bias: bool
    activation: str
    x_transposed: bool
    transpose_out: bool
    seed: int


@st.composite
def cases(draw, formats: Sequence[str], dtypes: Sequence[torch.dtype], *,
          shapes: Optional[Sequence[tuple[int, int]]] = None, multiple: tuple[int, int] = (1, 1),
          max_features: int = 96, m_values: Sequence[int] = range(10)) -> Case:
    """A random case. ``shapes`` fixes the (N, K) pairs to draw from; otherwise N and K are
    multiples of ``multiple`` (and of a BSR block) up to about ``max_features``. The rows of
    ``x`` are ``m_values`` (uniformly: 0 and 1 come up often), times a batch of 0 to 3 for a
    rank-3 ``x``."""
    fmt = draw(st.sampled_from(formats))
    spec = FormatSpec.parse(fmt)
    if shapes:
        n, k = draw(st.sampled_from(shapes))
    else:
        step_n, step_k = multiple
        if spec.kind == "bsr":
            step_n, step_k = math.lcm(step_n, spec.block[0]), math.lcm(step_k, spec.block[1])
        n = step_n * draw(st.integers(1, max(1, max_features // step_n)))
        k = step_k * draw(st.integers(1, max(1, max_features // step_k)))
    rank = draw(st.sampled_from([1, 2, 3]))
    x_transposed = draw(st.booleans())
    m = draw(st.sampled_from(m_values))
    rows = () if rank == 1 else (m,) if rank == 2 else (draw(st.sampled_from([2, 1, 3, 0])), m)
    if x_transposed and rank > 1:
        x_shape = (*rows[:-1], k, rows[-1])
    else:
        x_shape = (*rows, k)
    empty = draw(st.sampled_from(range(1, 26))) == 25       # about 1 case in 25
    return Case(fmt=fmt, dtype=draw(st.sampled_from(dtypes)), out_features=n, in_features=k,
                x_shape=x_shape, layout=draw(st.sampled_from(LAYOUTS)),
                density=0.0 if empty else draw(st.sampled_from([0.1, 0.3, 0.5, 0.8, 1.0])),
                bias=draw(st.booleans()), activation=draw(st.sampled_from(ACTIVATIONS)),
                x_transposed=x_transposed, transpose_out=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def random_weight(fmt: str, rows: int, cols: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """A float32 [N, K] weight that fits ``fmt`` with about ``density`` of its values kept
    (an n:m weight keeps ``density`` of its n per group). Never all zeros unless density is 0."""
    if density == 0.0:
        return torch.zeros(rows, cols)
    spec = FormatSpec.parse(fmt)
    if spec.kind == "nm":
        w = n_m(rows, cols, spec.n, spec.m, gen) * (torch.rand(rows, cols, generator=gen) < density)
    elif spec.kind == "bsr":
        w = block_sparse(rows, cols, spec.block, density, gen)
    else:
        w = unstructured(rows, cols, density, gen)
    if not w.any():
        w[0, 0] = nonzero_randn(1, generator=gen)[0]
    return w


def make_input(shape: tuple[int, ...], dtype: torch.dtype, layout: str, gen: torch.Generator,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """Random ``x`` of ``shape`` laid out as ``layout`` says. Memory next to the data that
    the op must not read (the gaps of a step slice, the element before an offset view)
    holds NaN, so reading it shows up in the output."""
    values = torch.randn(*shape, generator=gen).to(dtype).to(device)
    if layout == "transposed" and len(shape) > 1:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout in ("strided", "transposed"):                     # rank 1 has no transpose
        wide = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), dtype=dtype, device=device)
        wide[..., ::2] = values
        return wide[..., ::2]
    if layout == "offset":
        buffer = torch.full((values.numel() + 1,), float("nan"), dtype=dtype, device=device)
        buffer[1:] = values.reshape(-1)
        return buffer[1:].view(shape)
    return values


def make_tensors(case: Case, device: str | torch.device = "cpu"):
    """The case's dense weight [N, K], input and bias (or None), on ``device``."""
    gen = torch.Generator().manual_seed(case.seed)
    w = random_weight(case.fmt, case.out_features, case.in_features, case.density, gen)
    x = make_input(case.x_shape, case.dtype, case.layout, gen, device)
    bias = torch.randn(case.out_features, generator=gen).to(case.dtype).to(device) if case.bias else None
    return w.to(case.dtype).to(device), x, bias


def check_case(case: Case, run: RunOp = run_op, pack_fn: PackFn = pack,
               device: str | torch.device = "cpu", tolerance: dict = TOLERANCE) -> None:
    """Run one case and compare with the fp64 reference: same shape and dtype, a contiguous
    finite result, and an error within ``tolerance`` relative to the terms summed.

    The error is ``||got - ref|| / ||mag||`` with ``mag = |x| |W|^T + |b|``, the bound any
    floating-point dot product is held to (as BLAS test suites measure it). Relative to
    ``||ref||`` alone, a small random case whose sum cancels (one output near zero, or in
    the tail of GELU/SiLU where fp32 itself loses digits) would fail with no bug behind it.
    Where ``mag`` is zero (an empty weight and no bias) the output must be zeros.
    """
    w, x, bias = make_tensors(case, device)
    if case.layout == "offset" and x.numel():
        assert x.data_ptr() % 16, "the offset layout must give a misaligned input"
    got = run(pack_fn(w, case.fmt), x, bias, case.activation, case.x_transposed, case.transpose_out)
    ref = reference(x, w, bias, case.activation, case.x_transposed, case.transpose_out)
    assert tuple(got.shape) == tuple(ref.shape), (tuple(got.shape), tuple(ref.shape))
    assert got.dtype == case.dtype and got.device == x.device and got.is_contiguous()
    if ref.numel() == 0:
        return
    assert torch.isfinite(got).all(), "non-finite values in the output of finite inputs"
    mag = reference(x.abs(), w.abs(), None if bias is None else bias.abs(), "none",
                    case.x_transposed, case.transpose_out)
    difference = (got.double() - ref).norm().item()
    bound = tolerance[case.dtype]
    if mag.norm() == 0:
        assert difference == 0, f"{difference:.3g} away from the all-zero reference"
    else:
        error = difference / mag.norm().item()
        assert error <= bound, f"error {error:.3g} relative to |x||W|^T + |b| > {bound:.3g}"


def describe(case: Case) -> list[str]:
    """Tags of what a case exercises, to count them and show the harness covers them all."""
    rows = 1 if len(case.x_shape) == 1 else math.prod(case.x_shape) // case.in_features
    tags = [f"format {case.fmt}", f"dtype {str(case.dtype).replace('torch.', '')}",
            f"x rank {len(case.x_shape)}", f"layout {case.layout}", f"activation {case.activation}"]
    tags += ["bias"] * case.bias + ["x_transposed"] * case.x_transposed + ["transpose_out"] * case.transpose_out
    tags += ["empty batch (M = 0)"] * (rows == 0) + ["one row (M = 1)"] * (rows == 1)
    return tags + ["fully empty weight"] * (case.density == 0.0)


def fuzz(strategy: st.SearchStrategy[Case], examples: int, **check) -> Counter:
    """Run ``examples`` cases drawn from ``strategy`` through :func:`check_case` (its keyword
    arguments: the op under test) with a fixed seed, storing nothing. Returns the count of
    each :func:`describe` tag, and of all cases under ``"cases"``."""
    seen: Counter = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=strategy)
    def run_cases(case):
        seen.update(["cases", *describe(case)])
        check_case(case, **check)

    run_cases()
    return seen


def assert_covered(seen: Counter, examples: int, formats, dtypes, *, ranks=(1, 2, 3)) -> None:
    """The run had ``examples`` cases and drew every format, dtype, rank, layout and
    activation, both flags, an empty batch and an empty weight."""
    assert seen["cases"] >= examples, f"only {seen['cases']} cases ran"
    wanted = [f"format {f}" for f in formats] + \
             [f"dtype {str(d).replace('torch.', '')}" for d in dtypes] + \
             [f"x rank {r}" for r in ranks] + [f"layout {layout}" for layout in LAYOUTS] + \
             [f"activation {a}" for a in ACTIVATIONS] + \
             ["bias", "x_transposed", "transpose_out", "empty batch (M = 0)", "one row (M = 1)",
              "fully empty weight"]
    missing = [tag for tag in wanted if not seen[tag]]
    assert not missing, f"never drawn: {missing}"


def test_cpu_ops_fuzz():
    """Every CPU op on CPU_EXAMPLES random cases, none mismatching."""
    seen = fuzz(cases(CPU_FORMATS, CPU_DTYPES), CPU_EXAMPLES)
    print(dict(seen))
    assert_covered(seen, CPU_EXAMPLES, CPU_FORMATS, CPU_DTYPES)
