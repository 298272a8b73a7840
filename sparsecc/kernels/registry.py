"""The kernel families, and what the planner asks of them: which families may run a format for
a weight (and why none can), how a chosen site is packed, and which kernels a plan needs.

The planner never names a family: it asks here. Adding a family is one module implementing
:class:`~sparsecc.kernels.base.KernelFamily`, one template, and one entry in :data:`FAMILIES`.
A quantized (FP8) weight that stays dense runs on :data:`FP8_FAMILIES` where they take it, a 2:4
one on the FP8 2:4 GEMM (:mod:`sparsecc.kernels.fp8` says where).
Compile plans sparse formats only (a dense site runs torch's GEMM, which Inductor can fuse);
the dense families run a dense weight on sparsecc's own kernels where a caller asks for them.
"""
from __future__ import annotations

import torch

from ..codegen.spec import KernelSpec
from ..config import settings
from ..errors import InputError, KernelBuildError
from ..ir.formats import DENSE, NM_2_4, FormatSpec, PackedWeight
from ..ir.plan import ABOVE_DENSE
from ..ir.quant import E4M3, FP8_DTYPES
from ..runtime.kernel_op import ensure
from ..runtime.timing import packed_runner, time_all_us
from ..runtime.torch_ops import quantizer_spec
from . import fp8
from .base import KERNEL_DTYPES, KernelFamily, kernels_unavailable
from .bitmap import BitmapTiled
from .bsr import Bsr, rows_below_dense
from .by_rows import ByRowsWeight
from .csr import CsrTiled
from .csr_spmm import MAX_DENSITY as SPMM_MAX_DENSITY
from .csr_spmm import CsrSpmm
from .csr_split import CsrSplit
from .dense import SMALL as DENSE_SMALL
from .dense import DenseGemm
from . import sparse24_by_rows
from .sparse24_fp8 import SPARSE24_FP8
from .sparse24_small import GEMM, GEMV, MMA, choose

BSR, CSR_TILED, CSR_BITMAP, CSR_SPLIT, CSR_SPMM = Bsr(), CsrTiled(), BitmapTiled(), CsrSplit(), CsrSpmm()

#: every kernel family, in the order their kernels are preferred where several serve a site
FAMILIES: tuple[KernelFamily, ...] = (DenseGemm(), DENSE_SMALL, GEMM, GEMV, MMA, BSR, CSR_TILED, CSR_BITMAP, CSR_SPLIT,
                                      CSR_SPMM)
#: the families that run a quantized (FP8) site that stays dense, on torch's FP8 GEMM (nothing generated)
FP8_FAMILIES: tuple[KernelFamily, ...] = (fp8.SCALED_MM,)
#: the families that run a quantized (FP8) site packed sparse, where a plan asks for it
FP8_SPARSE_FAMILIES: tuple[KernelFamily, ...] = (SPARSE24_FP8,)
#: the format kinds compile may choose a kernel family for
PLANNED_KINDS = ("nm", "bsr", "csr")
#: the batch an unstructured weight's kernels are timed at when the site's batch is not known
UNKNOWN_M = 128
#: how a plan's reason names each CSR family it timed
CSR_LABELS = {CSR_TILED: "the tiled CSR kernel", CSR_BITMAP: "the bitmap kernel",
              CSR_SPLIT: "split onto the 2:4 kernels plus a residual pass", CSR_SPMM: "the CUDA-core CSR kernel"}


def by_impl(impl: str) -> KernelFamily | None:
    """The family that prices the cost model's implementation ``impl``, or None (torch's paths)."""
    return next((family for family in FAMILIES if impl in family.impls), None)


def opted_in() -> frozenset[str]:
    """The opt-in families compile may use: those ``SPARSECC_OPT_IN`` names (an unknown name is an
    error). The other families it always may."""
    names = frozenset(settings().opt_in)
    known = {f.name for f in FAMILIES if f.opt_in}
    if names - known:
        raise InputError(f"SPARSECC_OPT_IN names {sorted(names - known)}: the opt-in kernel families are "
                         f"{sorted(known)}")
    return names


def serving(spec: FormatSpec) -> list[KernelFamily]:
    """The families that run the format ``spec`` (whatever the weight) and compile may use."""
    if spec.kind not in PLANNED_KINDS:
        return []
    names = opted_in()
    return [family for family in FAMILIES if family.kind == spec.kind and (not family.opt_in or family.name in names)]


def refusal(spec: FormatSpec, shape: tuple[int, int], dtype: torch.dtype,
            device: torch.device | str | None = None, input_dtype: torch.dtype | None = None) -> str | None:
    """Why none of sparsecc's kernels runs ``spec`` for a weight of this shape and dtype, or None
    (an FP8 weight's dense product may run only where ``device`` is known and takes it; its 2:4
    product only for the ``input_dtype`` the kernels write, where known)."""
    if dtype in FP8_DTYPES:
        return fp8.refusal(spec, dtype, shape, device, input_dtype)
    reasons = [family.refuses(spec, shape, dtype) for family in serving(spec)]
    if not reasons:
        return f"sparsecc has no kernel for {spec}"
    return None if None in reasons else reasons[0]


def quantized_dense(shape: tuple[int, int],
                    device: torch.device | str) -> tuple[KernelFamily | None, str | None]:
    """The family that runs a quantized site that stays dense, with an e4m3 weight of ``shape``
    on ``device``, and why none does (one of the two is None). Its op takes any input and runs
    the reference op's product where the family cannot (another input dtype or device)."""
    reason = None
    for family in FP8_FAMILIES:
        reason = family.refuses(DENSE, shape, E4M3, device)
        if reason is None:
            return family, None
    return None, reason


def prepare_quantized_dense(shape: tuple[int, int], device: torch.device | str,
                            input_dtype: torch.dtype | None) -> str | None:
    """Load the kernel that rounds the inputs of a quantized site staying dense (on
    :data:`FP8_FAMILIES`) to e4m3 in one pass, where sparsecc's kernels run on ``device`` and the
    site's inputs are fp16 or bf16; elsewhere, or if it does not build, torch's ops round them (the
    same codes). Returns why it is not loaded, or None."""
    family, why = quantized_dense(shape, device)
    why = why or kernels_unavailable(device)
    if why is None and input_dtype not in KERNEL_DTYPES:
        why = f"the rounding kernel takes float16/bfloat16 inputs, not {input_dtype}"
    if why is None:
        try:
            ensure([quantizer_spec(input_dtype)], progress=False)
        except KernelBuildError as error:
            why = str(error).splitlines()[0]
    return why


def packed_nbytes(spec: FormatSpec, stats, element: int) -> int | None:
    """The bytes of a weight packed for sparsecc's kernels where their layout's differ from the
    portable format's (None: they do not)."""
    return next((n for family in serving(spec) for n in [family.nbytes(stats, element)] if n is not None), None)


def candidates(spec: FormatSpec, dtype: torch.dtype, shape: tuple[int, int], planned_m: int | None) -> list[KernelFamily]:
    """The families compile may pack a site of ``spec`` planned for ``planned_m`` rows into: for
    2:4 the one :func:`~sparsecc.kernels.sparse24_small.choose` picks, for CSR every family that
    takes the shape (the fastest on the weight is packed, :func:`pack_unstructured`); for a quantized
    2:4 weight the FP8 GEMM."""
    if dtype in FP8_DTYPES:
        return [SPARSE24_FP8] if SPARSE24_FP8.refuses(spec, shape, dtype) is None else []
    if spec == NM_2_4:
        return [choose(dtype, shape, planned_m)]
    return [family for family in serving(spec) if family.refuses(spec, shape, dtype) is None]


def small_batch_tier(spec: FormatSpec, dtype: torch.dtype, shape: tuple[int, int], lo: int,
                     hi: int) -> tuple[str, int] | None:
    """For a site of ``spec`` planned over ``lo..hi`` rows that may be packed twice by rows
    (:mod:`~sparsecc.kernels.by_rows`: 2:4's small-batch kernels at the low end and its GEMMs or
    the dense weight above; BSR's kernels at the low end and the dense weight above), how the plan
    names the kernels of the low end and the most rows they run; None where one packing serves
    the range."""
    if spec == NM_2_4:
        tier = sparse24_by_rows.small_tier(dtype, shape, lo, hi)
        return None if tier is None else (tier[0].unit, tier[1])
    if spec.kind == "bsr":
        limit = rows_below_dense(lo, hi)
        return None if limit is None else (BSR.unit, limit)
    return None


def members_dense_above(packed: PackedWeight, weights: list[torch.Tensor]) -> PackedWeight | None:
    """A sibling group's packing whose large batches run its stacked dense weight, with each
    member's own weight there instead (``weights``, in the group's order: the model's tensors, not
    a stacked copy); None where ``packed`` runs no dense weight above a small-batch tier."""
    if isinstance(packed, ByRowsWeight) and packed.large is None:
        return packed.for_members(weights)
    return None


def pack(weight: torch.Tensor, spec: FormatSpec, m: int | None, *, tune_range: tuple[int, int] | None = None,
         progress: bool = False, above: str | None = None, input_dtype: torch.dtype | None = None) -> PackedWeight:
    """``weight`` packed for the kernels that run ``spec`` at ``m`` rows (None: not known), its
    kernels loaded; the launches of the batches in ``tune_range`` are tuned first where they
    may be (:mod:`sparsecc.kernels.tune`). A 2:4 weight whose ``tune_range`` spans the
    small-batch kernels' rows and the GEMMs' is packed for both, or for the small-batch kernels
    and the dense weight where ``above`` says ``"dense"`` (:mod:`~sparsecc.kernels.sparse24_by_rows`);
    a block-sparse one so for the BSR kernels up to the rows of the range's low end
    (:func:`small_batch_tier`) and the dense weight above.
    A quantized 2:4 weight is packed for the FP8 GEMM writing y in ``input_dtype``, its site's."""
    reason = refusal(spec, tuple(weight.shape), weight.dtype, input_dtype=input_dtype)
    if reason:
        raise InputError(reason)
    if weight.dtype in FP8_DTYPES:
        return SPARSE24_FP8.pack(weight, spec, m, input_dtype=input_dtype, tune_range=tune_range, progress=progress)
    if spec == NM_2_4:
        return sparse24_by_rows.pack(weight, m, tune_range=tune_range, progress=progress, above=above)
    if spec.kind == "csr":
        return pack_unstructured(weight, m, tune_range=tune_range, progress=progress)
    packed = BSR.pack(weight, spec, m, tune_range=tune_range, progress=progress)
    limit = rows_below_dense(*tune_range) if above == ABOVE_DENSE and tune_range is not None else None
    if limit is None:
        return packed
    return ByRowsWeight(packed, limit, None, weight.detach(), selection=f"{BSR.unit} up to M={limit}, dense (torch) above")


def pack_unstructured(weight: torch.Tensor, m: int | None, *, tune_range: tuple[int, int] | None = None,
                      progress: bool = False) -> PackedWeight:
    """An unstructured weight packed for the fastest of the CSR families at ``m`` rows, timed on
    the weight itself (CUDA-graph replay, a few milliseconds each): the tiled kernels (their time
    follows the 64x64 tiles, whatever their entries), the bitmap kernel (the same pipeline, fewer
    bytes a non-zero: its time follows the tiles and the non-zeros), the split onto the 2:4 kernels plus a
    residual pass (its time follows the entries beyond two per group of four), and the CUDA-core
    kernel (its time follows the entries; timed up to :data:`SPMM_MAX_DENSITY`). Each wins
    somewhere, by shape, density and batch, hence the timing. The returned weight's
    ``selection`` says what was timed."""
    shape, dtype = tuple(weight.shape), weight.dtype
    density = int(torch.count_nonzero(weight)) / max(weight.numel(), 1)
    families = [f for f in candidates(FormatSpec("csr"), dtype, shape, m)
                if f is not CSR_SPMM or density <= SPMM_MAX_DENSITY]
    if not families:
        raise InputError(f"no CSR kernel takes this {shape[0]}x{shape[1]} weight at density {density:.3f}: "
                         f"{refusal(FormatSpec('csr'), shape, dtype) or CSR_TILED.refuses(FormatSpec('csr'), shape, dtype)}"
                         f" (the CUDA-core kernel takes weights at most {SPMM_MAX_DENSITY} dense)")
    packed = {}
    for family in families:
        weight_packed = family.pack(weight, FormatSpec("csr"), m, tune_range=tune_range, progress=progress)
        name = CSR_LABELS[family]
        if family is CSR_SPLIT:
            name = f"{name} of {weight_packed.residual_entries} entries"
        packed[name] = weight_packed
    if len(packed) == 1:
        return next(iter(packed.values()))
    rows = m or UNKNOWN_M
    times = time_all_us({name: packed_runner(p, rows, weight.device) for name, p in packed.items()}, weight.device)
    fastest = min(times, key=times.get)
    others = ", ".join(f"{name} {times[name]:.1f} us" for name in sorted(times, key=times.get) if name != fastest)
    packed[fastest].selection = f"{fastest}: {times[fastest]:.1f} us at M={rows}; {others}"
    return packed[fastest]


def kernel_specs(spec: FormatSpec, dtype: torch.dtype, shape: tuple[int, int], density: float,
                 m: int | None) -> list[KernelSpec]:
    """Every kernel a site of ``spec`` planned for ``m`` rows may run (what ``sparsecc generate``
    builds): those of every family :func:`candidates` lists (a CSR site's depend on its weight's
    fullest tile, which a plan does not record: the capacities its density may need)."""
    if refusal(spec, shape, dtype) is not None:
        return []
    return list(dict.fromkeys(s for family in candidates(spec, dtype, shape, m)
                              for s in family.kernel_specs(dtype, shape, spec, density, m)))


def _planned_weights(plan):
    """Each weight a plan's kernels run, as ``(format, dtype, shape, density, rows)``: its sites'
    (``choice``, ``dtype``, ``shape``, ``density``, and ``m`` or both ends of a declared
    ``m_range``), and the stacked weight of each group of sites that share one call (``group``).
    Sites of a dtype torch does not name are left out."""
    groups: dict[str, list] = {}
    for site in plan:
        if getattr(site, "group", None):
            groups.setdefault(site.group, []).append(site)
    stacked = [(members[0], [sum(s.shape[0] for s in members), members[0].shape[1]],
                sum(s.density * s.shape[0] for s in members) / sum(s.shape[0] for s in members))
               for members in groups.values()]
    for site, shape, density in [(site, site.shape, site.density) for site in plan] + stacked:
        dtype = getattr(torch, site.dtype, None)
        m_range = getattr(site, "m_range", None)
        if isinstance(dtype, torch.dtype):
            yield FormatSpec.parse(site.choice), dtype, tuple(shape), density, (m_range or [site.m, site.m])


def plan_kernels(plan) -> list[KernelSpec]:
    """Every kernel a plan's sites need (:func:`_planned_weights`): at the top and the bottom of a
    range, since a 2:4 site planned over one may run the small-batch kernels at its low end and the
    GEMMs at its top."""
    specs: list[KernelSpec] = []
    for spec, dtype, shape, density, (lo, hi) in _planned_weights(plan):
        for m in dict.fromkeys([hi, lo]):
            specs += kernel_specs(spec, dtype, shape, density, m)
    return list(dict.fromkeys(specs))


def tuning_kernels(plan) -> list[KernelSpec]:
    """The kernels tuning times for a plan's sites (``sparsecc generate --tuning``): every launch
    candidate of each tunable family that runs them, at each batch bucket their rows meet. With
    these in a kernel directory, a machine without a CUDA compiler tunes the model's shapes on its
    own GPU instead of running the shipped table's launches. For 2:4 that is all three of its
    families (:func:`~sparsecc.kernels.sparse24_small.choose` races two of them at a site's batch,
    and a range meets all three), with the kernels each packs its weight with (2:4's compressor)."""
    specs: list[KernelSpec] = []
    for spec, dtype, shape, density, (lo, hi) in _planned_weights(plan):
        if refusal(spec, shape, dtype) is not None:
            continue
        if spec == NM_2_4 and dtype not in FP8_DTYPES:     # packing races the three 2:4 families (choose)
            families = [family for family in (GEMV, MMA, GEMM) if family.refuses(spec, shape, dtype) is None]
        else:
            families = list(dict.fromkeys(family for m in (hi, lo) for family in candidates(spec, dtype, shape, m)))
        for family in (family for family in families if family.tunable):
            for _, m in family.buckets.meeting(lo, hi):      # its own kernels too: packing may run one
                specs += family.kernel_specs(dtype, shape, spec, density, m)
                specs += [launch.spec for launch in family.candidates(dtype, shape, m)]
    return list(dict.fromkeys(specs))
