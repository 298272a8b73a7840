"""The CUDA-core CSR kernel's layout and kernel spec (sparsecc.kernels.csr_spmm) on the CPU, and which
CSR kernels take which weights (sparsecc.kernels.registry.refusal)."""
from types import SimpleNamespace

import pytest
import torch

from sparsecc.codegen.render import render
from sparsecc.codegen.spec import Family, KernelSpec
from sparsecc.errors import InputError
from sparsecc.ir.formats import CSR
from sparsecc.kernels import registry
from sparsecc.kernels.csr_spmm import MAX_DENSITY as SPMM_MAX_DENSITY
from sparsecc.kernels.csr_spmm import MAX_K, CsrSpmmWeight, shape_supported, spmm_spec
from sparsecc.kernels.registry import plan_kernels


def unstructured(n, k, density, seed=0, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, k, generator=gen) + 3.0) * (torch.rand(n, k, generator=gen) < density)).to(dtype)


def test_layout_round_trips_with_empty_rows_and_an_empty_weight():
    w = unstructured(100, 72, 0.05, seed=1)
    w[7] = 0
    packed = CsrSpmmWeight.pack(w)
    assert packed.entries == int((w != 0).sum()) and torch.equal(packed.to_dense(), w)
    crow, col = packed.metadata[:101], packed.metadata[101:]
    assert crow[7] == crow[8] and col.numel() == packed.entries
    assert all(bool((col[crow[r]:crow[r + 1]].diff() > 0).all()) for r in range(100))   # ascending per row
    assert packed.nbytes == packed.entries * 6 + 101 * 4 and packed.spec.kind == "csr"
    empty = CsrSpmmWeight.pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    assert empty.entries == 0 and torch.equal(empty.to_dense(), torch.zeros(64, 64, dtype=torch.bfloat16))


def test_shapes_the_kernels_take():
    assert shape_supported(1000, 4096, torch.float16) is None
    assert "K % 8" in shape_supported(1000, 4100, torch.float16)
    assert f"K <= {MAX_K}" in shape_supported(1000, MAX_K + 8, torch.bfloat16)
    assert "float16/bfloat16" in shape_supported(64, 64, torch.float32)
    with pytest.raises(InputError, match="GPU"):
        registry.CSR_SPMM.pack(torch.ones(64, 64, dtype=torch.float16), CSR, None)
    # some CSR kernel takes a 16-bit weight with K % 8 == 0; none takes K % 8 != 0 or float32
    assert registry.refusal(CSR, (1000, 4104), torch.float16) is None              # the CUDA-core kernel only
    assert registry.refusal(CSR, (1000, 4096), torch.float16) is None              # split and CUDA cores
    assert "the CSR kernel needs" in registry.refusal(CSR, (128, 1020), torch.float16)
    assert registry.refusal(CSR, (128, 1024), torch.float32) is not None


def test_kernel_spec_and_source():
    spec = spmm_spec(torch.float16)
    assert spec.symbol == "sparsecc_spmm_sm90_f16_r8" and spec.family.own_launch and spec.family.per_entry
    source = render(spec)
    assert "sparsecc::stage_rows(x, m0, rows, k, staged, nonfinite, kThreads)" in source
    with pytest.raises(InputError):
        KernelSpec(Family.SPMM_SM90, "float16", transpose_out=True)


def test_plan_lists_the_cuda_core_kernel_for_very_sparse_sites():
    site = SimpleNamespace(choice="csr", dtype="bfloat16", shape=[1024, 4096], density=0.01, m=16)
    assert spmm_spec(torch.bfloat16) in plan_kernels([site])
    denser = SimpleNamespace(**{**vars(site), "density": 2 * SPMM_MAX_DENSITY})
    assert spmm_spec(torch.bfloat16) not in plan_kernels([denser])
