"""Split CSR weights (sparsecc.kernels.csr_split) on the CPU: the split is exact and fits 2:4, its
residual is what lies beyond two per group of four, the packed layout round-trips, the
residual pass's mode and kernel spec, the op's shapes and refusals, and the kernels a plan
lists for it."""
import math
from types import SimpleNamespace

import pytest
import torch

from sparsecc.codegen.render import render
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.errors import InputError
from sparsecc.ir.formats import CSR
from sparsecc.kernels import registry
from sparsecc.kernels.csr_split import (BY_ROWS, GATHER, STAGED_MIN_ENTRIES, TRANSPOSED, TRANSPOSED_MAX_ENTRIES,
                                        TRANSPOSED_MIN_ENTRIES, TRANSPOSED_MIN_ROWS, CsrSplitWeight, linear_split,
                                        residual_mode, residual_spec, shape_supported, split_24)
from sparsecc.kernels.registry import plan_kernels
from sparsecc.kernels.sparse24_small import Sparse24MmaWeight


def beyond_two_per_group(w):
    """Non-zeros beyond two in their group of four along K, counted group by group."""
    groups = torch.nn.functional.pad(w != 0, (0, -w.shape[1] % 4)).reshape(w.shape[0], -1, 4).sum(-1)
    return int((groups - 2).clamp(min=0).sum())


def unstructured(n, k, density, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, k, generator=gen) + 3.0) * (torch.rand(n, k, generator=gen) < density)).to(dtype)


@pytest.mark.parametrize("density", [0.01, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("k", [64, 30])
def test_split_is_exact_fits_24_and_leaves_what_lies_beyond_two_per_group(density, k):
    w = unstructured(96, k, density, seed=k)
    main, rest = split_24(w)
    assert torch.equal(main + rest, w) and not ((main != 0) & (rest != 0)).any()
    groups = torch.nn.functional.pad(main != 0, (0, -k % 4)).reshape(96, -1, 4)
    assert int(groups.sum(-1).max()) <= 2
    assert int((rest != 0).sum()) == beyond_two_per_group(w)
    # the first two non-zeros of a group (by position) stay in W24
    w = torch.tensor([[1.0, 0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    main, rest = split_24(w)
    assert main.tolist() == [[1, 0, 2, 0, 4, 5, 0, 0]] and rest.tolist() == [[0, 0, 0, 3, 0, 0, 6, 7]]


def test_a_random_weight_leaves_about_four_d_cubed_of_its_groups_to_the_residual():
    """E[entries beyond two per group] = sum_j (j - 2) C(4, j) d^j (1 - d)^(4 - j): at d = 0.05 an
    entry in about 8000 elements, at 0.3 one in 44."""
    for density in (0.05, 0.3):
        w = unstructured(1024, 2048, density, seed=1)
        d = float((w != 0).float().mean())
        expected = (4 * d ** 3 * (1 - d) + 2 * d ** 4) * w.numel() / 4
        assert abs(int((split_24(w)[1] != 0).sum()) / expected - 1) < 0.1, density


def test_packed_layout_round_trips_on_any_device():
    w = unstructured(64, 256, 0.2, seed=2, dtype=torch.float16)
    packed = CsrSplitWeight.pack(w, Sparse24MmaWeight.pack)
    assert packed.residual == "" and packed.residual_entries == beyond_two_per_group(w) > 0
    assert torch.equal(packed.to_dense(), w)
    crow = packed.residual_index[:65]
    assert crow[0] == 0 and crow[-1] == packed.residual_entries and bool((crow[1:] >= crow[:-1]).all())
    assert list(packed.tensors()) == ["values", "metadata", "residual_values", "residual_index"]
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in packed.tensors().values())
    assert packed.shape == (64, 256) and packed.spec.kind == "csr" and packed.op is linear_split
    empty = CsrSplitWeight.pack(torch.zeros(64, 256, dtype=torch.float16), Sparse24MmaWeight.pack)
    assert empty.residual_entries == 0 and torch.equal(empty.to_dense(), torch.zeros(64, 256, dtype=torch.float16))


def test_residual_pass_gathers_few_entries_stages_many_and_copies_x_transposed_between_at_large_batches():
    few = math.ceil(TRANSPOSED_MIN_ENTRIES * 1024)        # per input feature of a 4096 x 1024 weight
    many = TRANSPOSED_MAX_ENTRIES * 4096                  # per output feature
    for m in (1, 16, TRANSPOSED_MIN_ROWS - 1):           # small batches: never the copy of x
        assert residual_mode(0, 4096, 1024, m) == GATHER
        assert residual_mode(int(STAGED_MIN_ENTRIES * 4096) - 1, 4096, 1024, m) == GATHER
        assert residual_mode(int(STAGED_MIN_ENTRIES * 4096), 4096, 1024, m) == BY_ROWS
    for m in (TRANSPOSED_MIN_ROWS, 2048, None):          # large (or unknown) batches
        assert residual_mode(few - 1, 4096, 1024, m) == GATHER
        assert residual_mode(few, 4096, 1024, m) == residual_mode(many - 1, 4096, 1024, m) == TRANSPOSED
        assert residual_mode(many, 4096, 1024, m) == BY_ROWS           # many per output: staged
        assert residual_mode(10 * few, 4096, 1020, m) == BY_ROWS       # K % 8 != 0: no 16-byte columns of x^T


def test_residual_kernel_spec_and_source():
    spec = residual_spec(torch.bfloat16)
    assert spec.symbol == "sparsecc_residual_sm90_bf16_r8" and spec.family.own_launch
    source = render(spec)
    assert "residual_gather<false><<<" in source and "residual_staged<<<" in source
    assert "transpose_x<<<" in source and "residual_gather<true><<<" in source
    for bad in (dict(tile=(16, 256, 12288)), dict(x_transposed=True), dict(cluster=(2, 1))):
        with pytest.raises(InputError):
            KernelSpec(Family.RESIDUAL_SM90, "float16", **bad)


def test_shapes_and_dtypes_the_split_takes():
    assert shape_supported(4096, 4096, torch.float16) is None
    assert "float16/bfloat16" in shape_supported(4096, 4096, torch.float32)
    assert "K % 16" in shape_supported(4096, 4100, torch.float16)
    with pytest.raises(InputError, match="GPU"):
        registry.CSR_SPLIT.pack(torch.ones(64, 64, dtype=torch.float16), CSR, 16)


def test_op_shapes_and_cpu_refusal():
    packed = CsrSplitWeight.pack(unstructured(64, 128, 0.3, seed=3, dtype=torch.float16), Sparse24MmaWeight.pack)
    args = (*packed.tensors().values(), 64, 128)
    x = torch.randn(2, 5, 128, dtype=torch.float16)
    x_t = x.transpose(-1, -2).contiguous()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in (x, *args)]
        assert linear_split(*fake_args, None, "relu", False, False, "", "r:1").shape == (2, 5, 64)
        xt = mode.from_tensor(x_t)
        assert linear_split(xt, *fake_args[1:], None, "relu", True, True, "", "r:1").shape == (2, 64, 5)
    with pytest.raises(InputError, match="compiled for a CUDA GPU"):
        linear_split(x, *args, None, "relu", False, False, "", "")


def test_plan_lists_the_24_kernels_and_the_residual_pass_for_a_csr_site():
    site = SimpleNamespace(choice="csr", dtype="float16", shape=[1024, 4096], density=0.05, m=2048)
    specs = plan_kernels([site])
    families = {s.family for s in specs}
    assert {Family.RESIDUAL_SM90, Family.SM90_SPARSE24, Family.SM90_COMPRESS24, Family.CSR_SM90} <= families
    small = plan_kernels([SimpleNamespace(**{**vars(site), "m": 1})])
    assert Family.SM90_SPARSE24 not in {s.family for s in small} and residual_spec(torch.float16) in small
    odd = plan_kernels([SimpleNamespace(**{**vars(site), "shape": [1000, 4096]})])    # N % 64 != 0: split only
    assert Family.CSR_SM90 not in {s.family for s in odd} and residual_spec(torch.float16) in odd
    assert plan_kernels([SimpleNamespace(**{**vars(site), "dtype": "float32"})]) == []
