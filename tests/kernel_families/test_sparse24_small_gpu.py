"""The small-batch 2:4 kernels on the GPU (skipped without a Hopper GPU and nvcc), on CUDA
cores (templates/gemv_sm90_sparse24) and on tensor cores (templates/gemv_mma_sm90_sparse24):
every tiling against an fp64 reference at every M in 1..64 on an odd shape, every activation,
bias or none, poisoned outputs; the op with transposed layouts and the compiled model at the
batch each is planned for."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.ir.epilogue import ACTIVATION_CODES
from sparsecc.ir.formats import NM_2_4
from sparsecc.kernels.sparse24_small import GEMV, MMA, Sparse24GemvWeight, Sparse24MmaWeight, choose
from sparsecc.runtime.kernel_op import linear_kernel

from conftest import TOLERANCE, kernels_of_24_sites, rel_error
from kernel_families.test_gemm_gpu import every_candidate, reference, run_poisoned, sparse_weight

pytestmark = pytest.mark.gpu

ODD = (264, 1040)       # N, K: not multiples of any block's rows, nor of the tensor-core units (16 x 64)
#: each kind: its family, its packing, a batch a site is planned for it at
KINDS = {"cuda-cores": (GEMV, Sparse24GemvWeight, 1),
         "tensor-cores": (MMA, Sparse24MmaWeight, 4)}
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = [launch.spec for family, *_ in KINDS.values() for dtype in (torch.float16, torch.bfloat16)
           for launch in every_candidate(family, dtype, [ODD])]
KERNELS += kernels_of_24_sites([(4096, 4096)], [torch.float16])


def packed_for(kind, w):
    """``w`` packed for the kind's family, its dispatch table's kernels loaded."""
    family, _, batch = KINDS[kind]
    return family.pack(w, NM_2_4, batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_tiling_at_every_batch_size_up_to_64(kind, dtype):
    family, packing, _ = KINDS[kind]
    w = sparse_weight(*ODD, dtype)
    packed = packing.pack(w)
    bias = torch.randn(ODD[0], dtype=dtype, device="cuda")
    x_all = torch.randn(64, ODD[1], dtype=dtype, device="cuda")
    for launch in every_candidate(family, dtype, [ODD]):
        for m in range(1, 65):
            x = x_all[:m]
            y = run_poisoned(launch, packed.values, packed.metadata, x, bias, packed.out_features, "relu")
            error = rel_error(y, reference(x, w, bias, "relu"))
            assert error < TOLERANCE[dtype], (launch.label, m, error)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("activation", list(ACTIVATION_CODES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_activations_and_bias_on_a_real_shape(kind, activation, with_bias):
    dtype = torch.float16
    w = sparse_weight(4096, 4096, dtype)
    packed = packed_for(kind, w)
    bias = torch.randn(4096, dtype=dtype, device="cuda") if with_bias else None
    for m in (1, 3, 8, 16, 40):
        x = torch.randn(m, 4096, dtype=dtype, device="cuda")
        got = linear_kernel(x, packed.values, packed.metadata, 4096, 4096, bias, activation, False, False,
                            packed.kernels)
        assert rel_error(got, reference(x, w, bias, activation)) < TOLERANCE[dtype], m


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_through_the_op_and_exact_unpacking(kind):
    dtype = torch.bfloat16
    w = sparse_weight(1024, 4096, dtype)
    packed = packed_for(kind, w)
    assert torch.equal(packed.to_dense(), w)
    xt = torch.randn(4096, 5, dtype=dtype, device="cuda")
    got = linear_kernel(xt, packed.values, packed.metadata, 1024, 4096, None, "silu", True, True, packed.kernels)
    assert got.shape == (1024, 5)
    assert rel_error(got, reference(xt.t(), w, None, "silu").t()) < TOLERANCE[dtype]


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_right_after_packing_reads_the_packed_weight(kind):
    """The kernels start while the kernel before them ends and read their weight before they
    wait for it (programmatic dependent launch), so packing must be finished, not only ordered,
    before a call: each call here follows its weight's packing with no other work between."""
    dtype = torch.float16
    x = torch.randn(4, 4096, dtype=dtype, device="cuda")
    for seed in range(12):
        w = sparse_weight(4096, 4096, dtype, seed=seed)
        packed = packed_for(kind, w)
        got = linear_kernel(x, packed.values, packed.metadata, 4096, 4096, None, "relu", False, False,
                            packed.kernels)
        assert rel_error(got, reference(x, w, None, "relu")) < TOLERANCE[dtype], seed


@pytest.mark.parametrize("kind", KINDS)
def test_compile_at_a_small_batch_uses_the_small_batch_kernels(kind):
    """A model compiled at a small batch plans its 2:4 sites on the small-batch kernel
    sparse24_small.choose picks (one row: the CUDA-core kernel on weights of a few MB, where the
    tuning table has it fastest), and computes right at other batch sizes too."""
    family, _, batch = KINDS[kind]
    width, hidden = (768, 3072) if kind == "cuda-cores" else (2048, 8192)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, width)).half().cuda().eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(sparse_weight(*layer.weight.shape, torch.float16, seed=layer.weight.shape[0]))
            assert choose(torch.float16, tuple(layer.weight.shape), batch) is family
    x = torch.randn(batch, width, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    assert all(family.unit in site.reason for site in compiled.sparsecc_plan)
    with torch.no_grad():
        for rows in (1, 4, 7, 100):
            fresh = torch.randn(rows, width, dtype=torch.float16, device="cuda")
            assert rel_error(compiled(fresh), model(fresh)) < 1e-2
