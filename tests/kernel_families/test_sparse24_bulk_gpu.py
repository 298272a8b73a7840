"""The bulk-copy 2:4 small-batch kernel on the GPU (templates/gemv_mma_bulk_sm90_sparse24; skipped
without a Hopper GPU and nvcc): every tiling and cluster size against an fp64 reference at every M
in 1..64 on a shape whose N fills no block and whose K leaves the last stage part full, blocks
left without units of K, NaN and infinities of x where dense has them, and tuning that times it
beside the register kernel on a real shape."""
import logging

import pytest
import torch

from sparsecc.codegen.spec import TILES, Family, KernelSpec
from sparsecc.kernels import tune
from sparsecc.kernels.base import Launch
from sparsecc.ir.workload import dtype_name
from sparsecc.kernels.sparse24_small import MMA, Sparse24MmaWeight
from sparsecc.runtime.kernel_op import ensure, linear_kernel

from conftest import TOLERANCE, n_m, rel_error
from kernel_families.test_gemm_gpu import reference, run_poisoned, sparse_weight
from test_bad_input import assert_same_nonfinite, ieee_reference, scattered_nonfinite

pytestmark = pytest.mark.gpu

BULK = Family.GEMV_MMA_BULK_SM90_SPARSE24
#: N, K: N no multiple of a block's 32-128 features, K 17 units of 64 (a stage of 2 or 4 units
#: ends part full, and a cluster of 8 leaves blocks without units)
ODD = (264, 1088)
SPLITS = (0, 1, 2, 4, 8)
#: every tiling in fp16, two in bf16
TILINGS = [KernelSpec(BULK, "float16", tile=tile) for tile in sorted(TILES[BULK])]
TILINGS += [KernelSpec(BULK, "bfloat16", tile=(4, 4, 4)), KernelSpec(BULK, "bfloat16", tile=(8, 8, 2))]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = TILINGS + [launch.spec for launch in MMA.candidates(torch.float16, (4096, 4096), 32)
                     if launch.spec not in TILINGS]
KERNELS += [MMA.default_launch("bfloat16", 8).spec, MMA.default_launch("bfloat16", 64).spec]


@pytest.mark.parametrize("spec", TILINGS, ids=lambda spec: spec.symbol)
def test_every_tiling_and_cluster_at_every_batch_size_up_to_64(spec):
    dtype = getattr(torch, spec.dtype)
    w = sparse_weight(*ODD, dtype)
    packed = Sparse24MmaWeight.pack(w)
    bias = torch.randn(ODD[0], dtype=dtype, device="cuda")
    x_all = torch.randn(64, ODD[1], dtype=dtype, device="cuda")
    for splits in SPLITS:
        launch = Launch(spec, splits=splits)
        for m in range(1, 65):
            x = x_all[:m]
            y = run_poisoned(launch, packed.values, packed.metadata, x, bias, packed.out_features, "relu")
            error = rel_error(y, reference(x, w, bias, "relu"))
            assert error < TOLERANCE[dtype], (splits, m, error)


def test_short_k_leaves_blocks_of_a_cluster_without_units():
    """K = 128 is two units: in a cluster of 8, six blocks multiply nothing and add zeros."""
    dtype = torch.float16
    w = sparse_weight(96, 128, dtype)
    packed = Sparse24MmaWeight.pack(w)
    x = torch.randn(20, 128, dtype=dtype, device="cuda")
    for tile in ((4, 4, 4), (8, 4, 2), (2, 4, 2)):
        y = run_poisoned(Launch(KernelSpec(BULK, "float16", tile=tile), splits=8), packed.values, packed.metadata, x,
                         None, 96, "none")
        assert rel_error(y, reference(x, w, None, "none")) < TOLERANCE[dtype], tile


@pytest.mark.parametrize("rows", [1, 9, 33, 64])
def test_scattered_nonfinite_inputs_meet_the_right_zeros(rows):
    """One NaN, +Inf or -Inf per row of x at a random place (two infinities of opposite signs in
    one row): each output NaN, +Inf, -Inf or finite exactly as dense F.linear gives it, through
    every consumer part and unit row of the block."""
    n, k = 136, 576
    gen = torch.Generator().manual_seed(rows)
    for dtype, tile in ((torch.float16, (4, 8, 4)), (torch.bfloat16, (8, 8, 2)), (torch.float16, (2, 8, 2))):
        w = (n_m(n, k, 2, 4, gen) / k ** 0.5).to(dtype).cuda()
        packed = Sparse24MmaWeight.pack(w)
        x = scattered_nonfinite(rows, k, gen).to(dtype).cuda()
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        for splits in (1, 4):
            got = run_poisoned(Launch(KernelSpec(BULK, dtype_name(dtype), tile=tile), splits=splits), packed.values,
                               packed.metadata, x, bias, n, "relu")
            ref = ieee_reference(x, w, bias, "relu")
            assert ref.isnan().any() and ref.isfinite().any()
            assert_same_nonfinite(got, ref, dtype)


def test_tuning_times_it_beside_the_register_kernel(tmp_path, monkeypatch, caplog):
    """Tuning a 4096x4096 weight at 32 rows times the bulk-copy launches with the others, each
    held to the reference (none left out for a wrong result or a refusal), and records the fastest
    of all under the family's table."""
    monkeypatch.setenv("SPARSECC_TUNE", "new")
    monkeypatch.setattr(tune, "_TUNED_THIS_PROCESS", set())
    tune.use(tune.TuningTable([], tmp_path / "tuning.json", tune.machine_key(torch.device("cuda"))))
    try:
        with caplog.at_level(logging.WARNING, logger="sparsecc"):
            found = tune.tune_bucket(MMA, torch.float16, (4096, 4096), 32, progress=False)
        assert not [r for r in caplog.records if "left out" in r.getMessage()]
        assert found is not None and found["family"] == Family.GEMV_MMA_SM90_SPARSE24.value
        assert tune.LOG[-1].candidates == len(MMA.candidates(torch.float16, (4096, 4096), 32))
    finally:
        tune.use(None)


def test_through_the_op_in_every_layout_beside_the_register_kernel():
    """A weight whose dispatch runs the bulk-copy kernel at 9-32 rows and the register kernel
    elsewhere, through sparsecc::linear_kernel: x transposed or not, y transposed or not, a batch
    in each bucket, against fp64."""
    dtype = torch.bfloat16
    w = sparse_weight(1024, 2048, dtype)
    table = [(8, MMA.default_launch("bfloat16", 8)), (32, Launch(KernelSpec(BULK, "bfloat16", tile=(4, 4, 4)), splits=0)),
             (0, MMA.default_launch("bfloat16", 64))]
    packed = Sparse24MmaWeight.pack(w).running(table)
    ensure([launch.spec for _, launch in table])
    torch.cuda.synchronize()               # the kernels read the weight before they wait: packed first
    bias = torch.randn(1024, dtype=dtype, device="cuda")
    for m in (5, 9, 27, 32, 50):
        x = torch.randn(m, 2048, dtype=dtype, device="cuda")
        want = reference(x, w, bias, "gelu")
        for x_transposed, transpose_out in ((False, False), (True, False), (False, True), (True, True)):
            given = x.t().contiguous() if x_transposed else x
            got = linear_kernel(given, packed.values, packed.metadata, 1024, 2048, bias, "gelu", x_transposed,
                                transpose_out, packed.kernels)
            got = got.t() if transpose_out else got
            assert rel_error(got, want) < TOLERANCE[dtype], (m, x_transposed, transpose_out)
