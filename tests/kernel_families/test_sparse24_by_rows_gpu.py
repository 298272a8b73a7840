"""A 2:4 weight packed over a batch range that spans the small-batch kernels and the GEMMs, on the
GPU (skipped without a Hopper GPU and nvcc): both tiers, the GEMMs' or the dense weight above,
against an fp64 reference at one row, at the small tier's limit, one row past it and at the
prefill's rows; and a model compiled for such a range runs both tiers (fp16 tolerance)."""
import pytest
import torch
import torch.nn as nn

import sparsecc
from sparsecc.ir.formats import NM_2_4
from sparsecc.ir.plan import ABOVE_DENSE
from sparsecc.kernels import registry
from sparsecc.kernels.by_rows import ByRowsWeight

from conftest import kernels_of_24_sites, rel_error
from kernel_families.test_gemm_gpu import reference, sparse_weight

pytestmark = pytest.mark.gpu

SHAPE = (1024, 2048)
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites([SHAPE], [torch.float16])


@pytest.mark.parametrize("above", [None, ABOVE_DENSE])
def test_both_tiers_compute_the_layer(above):
    w = sparse_weight(*SHAPE, torch.float16)
    packed = registry.pack(w, NM_2_4, 512, tune_range=(1, 512), above=above)
    assert isinstance(packed, ByRowsWeight) and packed.limit >= 1
    assert (packed.large is None) == (above == ABOVE_DENSE)
    bias = torch.randn(SHAPE[0], dtype=torch.float16, device="cuda")
    for rows in sorted({1, packed.limit, packed.limit + 1, 512}):
        x = torch.randn(rows, SHAPE[1], dtype=torch.float16, device="cuda")
        got = packed.op(x, *packed.tensors().values(), *packed.scalars().values(), bias, "silu", False, False,
                        *packed.extra_args)
        assert rel_error(got, reference(x, w, bias, "silu")) < 3e-3, rows


def test_a_model_compiled_for_decode_and_prefill_packs_both_tiers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(SHAPE[1], SHAPE[0]), nn.ReLU()).half().cuda().eval()
    sparsecc.prune(model, "2:4")
    compiled = sparsecc.compile(model, torch.randn(512, SHAPE[1], dtype=torch.float16, device="cuda"),
                                formats=("2:4",), m_range=(1, 512))
    assert "up to M=" in compiled.sparsecc_plan["0"].reason
    with torch.no_grad():
        for rows in (1, 512):
            x = torch.randn(rows, SHAPE[1], dtype=torch.float16, device="cuda")
            assert rel_error(compiled(x), model(x)) < 1e-2, rows
