"""The registry of kernel families (sparsecc.kernels.registry): what the planner asks of the
families, answered without naming one."""
from types import SimpleNamespace

import pytest
import torch

from conftest import block_sparse, n_m, unstructured
from sparsecc.codegen.spec import Family
from sparsecc.errors import InputError
from sparsecc.ir.analysis import analyze
from sparsecc.ir.formats import NM_2_4, FormatSpec
from sparsecc.kernels import registry
from sparsecc.kernels.base import KernelFamily
from sparsecc.ir.workload import Workload
from sparsecc.planner.work import TORCH_PATHS, known, work


def test_every_family_implements_the_interface_and_every_template_has_a_home():
    """Each family names its format, templates, unit and implementations; every template but
    none is rendered by exactly one family; every priced implementation has one family."""
    homes = {}
    for family in registry.FAMILIES + registry.FP8_FAMILIES + registry.FP8_SPARSE_FAMILIES:
        assert isinstance(family, KernelFamily) and family.kind in ("dense", "nm", "bsr", "csr")
        assert family.name and family.unit and family.templates
        for template in family.templates:
            homes.setdefault(template, []).append(family.name)
        for impl in family.impls:
            assert registry.by_impl(impl) is family
        if family.tunable:
            assert list(family.buckets)[-1][0] == 0
    assert set(homes) == set(Family), f"templates without a family: {set(Family) - set(homes)}"
    assert {t: names for t, names in homes.items() if len(names) > 1} == {}
    assert registry.by_impl("dense") is None and set(TORCH_PATHS).isdisjoint(
        impl for family in registry.FAMILIES for impl in family.impls)


@pytest.mark.parametrize("spec, shape, dtype, refused", [
    (NM_2_4, (4096, 4096), torch.float16, False),
    (NM_2_4, (4096, 4100), torch.float16, True),          # K not a multiple of 16
    (NM_2_4, (4096, 4096), torch.float32, True),          # the kernels take fp16/bf16
    (FormatSpec("nm", n=1, m=4), (4096, 4096), torch.float16, True),    # only 2:4 on sparse tensor cores
    (FormatSpec("bsr", block=(64, 64)), (4096, 4096), torch.bfloat16, False),
    (FormatSpec("bsr", block=(8, 8)), (4096, 4096), torch.float16, True),
    (FormatSpec("csr"), (4096, 4096), torch.float16, False),
    (FormatSpec("csr"), (200, 4096), torch.float16, False),   # the split takes N % 8 where the tiled kernel needs 64
    (FormatSpec("dense"), (4096, 4096), torch.float16, True),  # compile runs dense sites on torch
])
def test_refusal_says_why_no_kernel_runs_a_format(spec, shape, dtype, refused):
    reason = registry.refusal(spec, shape, dtype)
    assert (reason is not None) == refused, reason


def test_csr_candidates_are_every_family_that_takes_the_shape():
    names = lambda shape: [f.name for f in registry.candidates(FormatSpec("csr"), torch.float16, shape, 16)]  # noqa: E731
    assert names((4096, 4096)) == ["csr-tiled", "csr-split", "csr-spmm"]
    assert names((200, 4096)) == ["csr-split", "csr-spmm"]        # N % 64 != 0: not the tiled kernels
    assert names((4096, 16384)) == ["csr-tiled", "csr-split"]        # past the CUDA-core kernel's K


def test_opt_in_families_are_candidates_only_where_named(monkeypatch):
    """The bitmap kernel is opt-in: a CSR site may be packed for it (compile times it with the
    others) only under SPARSECC_OPT_IN=bitmap; a name that is no opt-in family is refused."""
    names = lambda: [f.name for f in registry.candidates(FormatSpec("csr"), torch.float16, (4096, 4096), 16)]  # noqa: E731
    assert "bitmap" not in names()
    monkeypatch.setenv("SPARSECC_OPT_IN", "Bitmap")
    assert names() == ["csr-tiled", "bitmap", "csr-split", "csr-spmm"]
    assert registry.by_impl("bitmap-kernel") is registry.CSR_BITMAP
    monkeypatch.setenv("SPARSECC_OPT_IN", "bitmap,csr-tiled")
    with pytest.raises(InputError, match="csr-tiled.*opt-in kernel families are \\['bitmap'\\]"):
        names()


def test_every_kernel_implementation_has_a_work_model(gen):
    """The cost model prices sparsecc's kernels through their families: each implementation the
    planner can produce has a work model giving positive flops (or none) and bytes."""
    weights = {NM_2_4: n_m(512, 1024, 2, 4, gen, torch.float16),
               FormatSpec("bsr", block=(64, 64)): block_sparse(512, 1024, (64, 64), 0.3, gen, torch.float16),
               FormatSpec("csr"): unstructured(512, 1024, 0.3, gen, torch.float16)}
    seen = set()
    for spec, weight in weights.items():
        stats = analyze(weight)
        for m in (1, 16, 200, 4096):
            for family in registry.candidates(spec, weight.dtype, stats.shape, m):
                for w in family.workloads(stats, spec, m, m):
                    flops, nbytes = work(w)
                    assert known(w.impl) and flops >= 0 and nbytes > 0, w
                    seen.add(w.impl)
    assert {"sparse24-gemv", "sparse24-mma", "sparse24-gemm", "bsr-kernel", "bsr-kernel-mma", "csr-kernel",
            "csr-residual"} <= seen
    with pytest.raises(ValueError, match="unknown implementation"):
        work(Workload("bsr-kernel-small", "float16", 1, 64, 64))


def test_plan_kernels_lists_what_each_site_may_run():
    sites = [SimpleNamespace(choice="2:4", dtype="float16", shape=(4096, 4096), density=0.5, m=1),
             SimpleNamespace(choice="2:4", dtype="float16", shape=(4096, 4096), density=0.5, m=512),
             SimpleNamespace(choice="bsr64x64", dtype="bfloat16", shape=(4096, 4096), density=0.1, m=16),
             SimpleNamespace(choice="dense", dtype="float16", shape=(4096, 4096), density=1.0, m=16),
             SimpleNamespace(choice="2:4", dtype="float32", shape=(4096, 4096), density=0.5, m=16)]
    families = {spec.family for spec in registry.plan_kernels(sites)}
    assert Family.GEMV_SM90_SPARSE24 in families or Family.GEMV_MMA_SM90_SPARSE24 in families   # M = 1
    assert {Family.SM90_SPARSE24, Family.SM90_COMPRESS24} <= families                            # M = 512
    assert {Family.BSR_MMA_SM90, Family.BSR_SM90_WGMMA, Family.BSR_SM90_PAIRS} <= families
    assert all(spec.dtype in ("float16", "bfloat16") for spec in registry.plan_kernels(sites))


def test_plan_kernels_include_a_sibling_groups_stacked_weight():
    """Sites that share one call run the kernels of their stacked shape, which may differ from
    each one's: four 512 x 2048 weights at 64 rows run the small-batch tensor-core kernels, stacked
    (2048 x 2048) the GEMMs."""
    names = ["a.weight", "b.weight", "c.weight", "d.weight"]
    sites = [SimpleNamespace(choice="2:4", dtype="float16", shape=(512, 2048), density=0.5, m=64, m_range=[1, 64],
                             group="+".join(names), name=name) for name in names]
    specs = registry.plan_kernels(sites)
    for m in (1, 64):
        assert set(registry.kernel_specs(FormatSpec.parse("2:4"), torch.float16, (2048, 2048), 0.5, m)) <= set(specs)
    alone = registry.plan_kernels([SimpleNamespace(**{**vars(site), "group": None}) for site in sites])
    assert set(alone) < set(specs)
    assert Family.SM90_SPARSE24 in {s.family for s in specs} - {s.family for s in alone}


def test_packing_refuses_what_no_kernel_runs():
    with pytest.raises(Exception, match="2:4"):
        registry.pack(torch.zeros(64, 64), FormatSpec("nm", n=1, m=4), 1)
