"""The fuzz harness of tests/test_fuzz.py on the real kernels: sparsecc::linear_kernel with
2:4 weights compressed by CUTLASS, fp16 and bf16, every epilogue, layout flag, rank and
stride, batch sizes across the dispatch buckets (skipped without a Hopper GPU and nvcc)."""
import os

import pytest
import torch

from sparsecc.ir.formats import NM_2_4
from sparsecc.kernels.sparse24_small import GEMM

from conftest import kernels_of_24_sites
from test_fuzz import assert_covered, cases, fuzz

pytestmark = pytest.mark.gpu

GPU_FORMATS = ("2:4",)
GPU_DTYPES = (torch.float16, torch.bfloat16)
GPU_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1e-2}
#: 300 in a routine run; SPARSECC_GPU_FUZZ_EXAMPLES=2000 runs as many cases as the CPU harness
GPU_EXAMPLES = int(os.environ.get("SPARSECC_GPU_FUZZ_EXAMPLES", "300"))
#: a few weight shapes the kernels take (N % 8 == 0, K % 16 == 0), so that the few
#: launches their dispatch tables name are built once
SHAPES = [(8, 16), (24, 48), (64, 96), (40, 128), (136, 80)]
#: rows of x: small ones often, and each side of the dispatch buckets' bounds (1, 16, 128, 2048)
M_VALUES = (0, 1, 2, 3, 5, 8, 15, 16, 17, 33, 127, 128, 129, 700, 2048, 2049)
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites(SHAPES, GPU_DTYPES)


def pack_cutlass(weight, fmt):
    assert fmt == "2:4"
    return GEMM.pack(weight, NM_2_4, None)


def run_kernel(packed, x, bias, activation, x_transposed, transpose_out):
    return packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, activation,
                     x_transposed, transpose_out, *packed.extra_args)


def test_kernel_op_fuzz():
    """The CUDA kernel op on GPU_EXAMPLES random cases, none mismatching."""
    strategy = cases(GPU_FORMATS, GPU_DTYPES, shapes=SHAPES, m_values=M_VALUES)
    seen = fuzz(strategy, GPU_EXAMPLES, run=run_kernel, pack_fn=pack_cutlass, device="cuda",
                tolerance=GPU_TOLERANCE)
    print(dict(seen))
    assert_covered(seen, GPU_EXAMPLES, GPU_FORMATS, GPU_DTYPES)
