"""The 2:4 CUTLASS GEMM family on the CPU (sparsecc.kernels.sparse24): which launches tuning times
at which batch, the 96-row bucket the shipped table predates, the work model of K in slices, and
(where nvcc is) the sliced kernel's layouts checked on the host. Its kernels on the GPU:
test_gemm_gpu.py."""
import subprocess

import pytest
import torch

from sparsecc.codegen.render import render
from sparsecc.codegen.spec import Family, KernelSpec, Scheduler
from sparsecc.ir.workload import Workload
from sparsecc.kernels import tune
from sparsecc.kernels.base import Launch, launch_for
from sparsecc.kernels.sparse24 import FEW_ROWS_MAX_M, Sparse24Gemm, k_slices

from conftest import host_program, requires_nvcc

GEMM = Sparse24Gemm()
SMS = 132


def launch(tile, **config):
    return Launch(KernelSpec(Family.SM90_SPARSE24, "float16", tile=tile, **config))


def test_few_row_launches_are_tuned_only_where_they_can_win():
    """Tiles of 32 rows of x and K in slices are candidates up to a few dozen rows, not for the
    thousands of rows where one wave of wide tiles fills the GPU."""
    def kinds(m):
        return {(c.spec.tile[1], c.spec.scheduler) for c in GEMM.candidates(torch.float16, (4096, 14336), m)}

    few = {(32, Scheduler.PERSISTENT), (32, Scheduler.SLICED), (64, Scheduler.SLICED)}
    assert few <= kinds(32) and few <= kinds(FEW_ROWS_MAX_M)
    assert not few & kinds(2048)


@pytest.fixture
def table():
    def use(entries):
        tune.use(tune.TuningTable(entries))
    yield use
    tune.use(None)


def test_the_96_row_bucket_keeps_the_128_row_launch_until_it_is_measured(table):
    """65-96 rows ran the launch of the 128-row bucket before the 96-row bucket existed: a table
    with nothing at M = 96 keeps that; one measured at 96 rows is taken."""
    at_128, at_96 = launch((128, 128, 128)), launch((128, 32, 128), scheduler=Scheduler.SLICED)
    shape = (4096, 4096)
    entries = [tune.entry(Family.SM90_SPARSE24, "float16", 128, *shape, at_128, 20.0)]
    table(entries)
    dispatch = GEMM.dispatch(torch.float16, shape)
    assert launch_for(dispatch, 70) == launch_for(dispatch, 96) == launch_for(dispatch, 128) == at_128
    assert launch_for(dispatch, 64).spec.tile == (128, 64, 128)           # no entry at 64: the default
    table(entries + [tune.entry(Family.SM90_SPARSE24, "float16", 96, *shape, at_96, 15.0)])
    dispatch = GEMM.dispatch(torch.float16, shape)
    assert launch_for(dispatch, 96) == at_96 and launch_for(dispatch, 97) == at_128


@pytest.mark.parametrize("tiles, k, requested, expected", [
    (32, 14336, 0, 4),       # 132 SMs / 32 tiles; 14336 = 4 x 3584
    (32, 1040, 0, 1),        # K not in whole 128-column atoms: not cut
    (32, 4096, 16, 16),      # 16 slices of 256 columns: two k-tiles each
    (32, 2048, 16, 8),       # 16 would leave one k-tile a slice
    (300, 8192, 0, 1),       # more tiles than SMs
])
def test_k_slices_follow_the_kernels_rules(tiles, k, requested, expected):
    assert k_slices(tiles, k, requested, SMS) == expected


def test_slicing_k_fills_the_sms_at_the_price_of_the_fp32_sums():
    """32 rows of a 4096-row weight are 32 tiles of 128 x 32: alone a quarter of the SMs, so the
    unsliced launch is priced at four waves' worth of math; in 4 slices one wave, plus the fp32
    slices written and read back."""
    base = dict(impl=GEMM.name, dtype="float16", m=32, n=4096, k=14336, density=0.5, tile=(128, 32))
    whole_math, whole_bytes = GEMM.work(Workload(**base), SMS)
    sliced_math, sliced_bytes = GEMM.work(Workload(**base, mode=0), SMS)
    assert whole_math == pytest.approx(32 * 128 * 32 * 14336 * SMS / 32)
    assert sliced_math == pytest.approx(32 * 128 * 32 * 14336 * SMS / 128)
    assert sliced_bytes - whole_bytes == 2 * 4 * 32 * 4096 * 4


def test_a_sliced_launch_names_its_slices_in_the_workload(table):
    stats = type("Stats", (), {"shape": (4096, 14336), "dtype": "float16", "density": 0.5})()
    sliced = launch((128, 32, 128), scheduler=Scheduler.SLICED)
    table([tune.entry(Family.SM90_SPARSE24, "float16", 32, 4096, 14336, sliced, 20.0),
           tune.entry(Family.SM90_SPARSE24, "float16", 64, 4096, 14336,
                      Launch(sliced.spec, splits=4), 25.0)])
    assert [w.mode for w in GEMM.workloads(stats, None, 32, None)] == [0]
    assert [w.mode for w in GEMM.workloads(stats, None, 64, None)] == [4]
    assert [w.mode for w in GEMM.workloads(stats, None, 128, None)] == [None]


#: appended to the rendered sliced kernel and run on the host (no GPU): for K cut into 2, 4 and 8
#: slices, the layouts make_arguments gives the batched GEMM address exactly the entries of the
#: whole weight's values and metadata that the unsliced layouts give, slice by slice; and CUTLASS's
#: can_implement takes the packed layout the kernel shows it, not the real one; and the slices it
#: cuts K into for requested counts (which the cost model's k_slices mirrors)
SLICED_LAYOUT_CHECK = r"""
int main() {
  const int m = 256, n = 40, k = 2048;
  int failed = 0;
  for (int slices : {2, 4, 8}) {
    const int ks = k / slices;
    auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, 0, nullptr, 1, slices);
    auto full_a = SparseConfig::fill_layoutA(Shape<int, int, int, int>{m, n, k, 1});
    auto full_e = SparseConfig::fill_layoutE(Shape<int, int, int, int>{m, n, k, 1});
    long wrong = (get<2>(args.problem_shape) != ks) + (get<3>(args.problem_shape) != slices);
    for (int l = 0; l < slices; ++l)
      for (int r = 0; r < m; ++r)
        for (int c = 0; c < ks; ++c) {
          wrong += args.mainloop.layout_a(r, c, l) != full_a(r, l * ks + c, 0);
          wrong += args.mainloop.layout_e(r, c, l) != full_e(r, l * ks + c, 0);
        }
    auto packed = args;
    packed.mainloop.layout_a = SparseConfig::fill_layoutA(args.problem_shape);
    const bool packed_taken = Gemm::can_implement(packed) == cutlass::Status::kSuccess;
    const bool real_refused = Gemm::can_implement(args) != cutlass::Status::kSuccess;
    std::printf("slices=%d wrong=%ld packed_taken=%d real_refused=%d\n", slices, wrong, packed_taken, real_refused);
    failed += wrong != 0 || !packed_taken || !real_refused;
  }
  for (int kk : {768, 1040, 2048, 4096, 14336})
    for (int requested : {2, 3, 4, 8, 16}) std::printf("slices_for %d %d %d\n", kk, requested, slices_for(m, n, kk, requested));
  return failed;
}
"""


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_sliced_kernel_layouts_address_the_whole_weight(tmp_path):
    """The sliced 2:4 GEMM reads one compressed weight through CUTLASS's layouts of an m x ks
    problem batched over the slices: checked entry by entry against the whole weight's layouts, on
    the host, by the rendered kernel's own make_arguments."""
    spec = KernelSpec(Family.SM90_SPARSE24, "float16", tile=(128, 32, 128), scheduler=Scheduler.SLICED)
    program = host_program(render(spec) + SLICED_LAYOUT_CHECK, tmp_path)
    result = subprocess.run([str(program)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("wrong=0 packed_taken=1 real_refused=1") == 3, result.stdout
    picked = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("slices_for")]
    assert len(picked) == 25
    for k, requested, slices in picked:            # the cost model's mirror of the kernel's rule
        assert k_slices(16, int(k), int(requested), SMS) == int(slices), (k, requested, slices)
