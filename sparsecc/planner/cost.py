"""Cost model: predicted time of every exact candidate format for a site, per batch range,
and a choice the plan explains.

A candidate's time is predicted for the implementation that would run it on the device
(sparsecc's 2:4 GEMM or small-batch kernel, torch's dense, n:m, BSR or CSR paths) from the
flops and bytes of the work and that implementation's numbers measured on this machine
(:mod:`sparsecc.planner.fit`; ``sparsecc calibrate`` measures them, else sparsecc uses the
ones shipped for the device type). The choice is made per site over the batch sizes the
user declares -- the M of the example inputs, or ``m_range=(lo, hi)`` split into buckets --
for one of two objectives:

- ``"latency"``: the format whose worst bucket is closest to that bucket's fastest
  format (timed, see below; from the predictions alone, a sparse format must be predicted
  :data:`DENSE_MARGIN` and :data:`MIN_GAIN_US` faster than dense in every bucket, so a
  prediction error does not make a model slower than it was).
- ``"memory"``: the fewest bytes among the formats predicted at most ``max_slowdown``
  times the fastest in every bucket.

The predictions make a shortlist and timing decides: the candidates predicted within
:data:`SHORTLIST_FACTOR` of the fastest in every bucket (at most :data:`SHORTLIST_MAX`,
dense besides) are timed on the site's own weight as compile would run them, at the M of
the example (or of the largest declared bucket) (:func:`time_sites`: CUDA-graph replay on
the GPU, interleaved rounds on the CPU, a close call timed again), and the
fastest is kept -- a sparse one only if it beat dense by :data:`MEASURED_MARGIN`. Timing a
few candidates costs milliseconds per site, and settles what a few fitted numbers cannot:
two block shapes of one weight predicted within 20% of each other, or a CPU library path
(MKL's gemv against its gemm, torch's sparse kernels) that the model only approximates.
Sites whose candidates' times cannot depend on the weight's values share one timing; past
:data:`TIMING_BUDGET_S` of timing in a plan, predictions decide the remaining sites (their
reasons say so). ``CostModel(measure=False)`` chooses from the predictions alone.

A quantized site (an e4m3 weight, made by ``sparsecc.quantize``) is decided apart
(:meth:`CostModel.decide`): it stays dense (on ``torch._scaled_mm`` where the registry's FP8 family
takes it on this device, else on its FP8 reference op) unless ``formats`` asks for an n:m format
its weight fits (2:4 then runs on the FP8 2:4 GEMM where it takes the weight on this device, else on
its reference op). An FP8 format is a candidate only for an FP8 weight, so a model that was not
quantized never runs one.

A model whose ops run one by one from the host (``op_by_op=True``: the ``torch.compile``
backend without CUDA graphs) also pays each op's host time, and where the host sets the pace
a kernel's saving on the GPU is lost to it. There a sparse candidate is charged the host time
its call costs beyond dense's (measured with its timing, :func:`~sparsecc.runtime.timing.host_us`;
:data:`PREDICTED_EXTRA_HOST_US` where only predicted): a site whose saving is smaller stays dense.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from ..errors import InputError, SparseccError
from ..ir.analysis import WeightStats
from ..ir.epilogue import Epilogue
from ..ir.formats import DENSE, NM_2_4, FormatSpec, pack
from ..ir.plan import ABOVE_DENSE
from ..ir.workload import Workload
from ..kernels import registry
from ..kernels.base import kernels_unavailable as kernels_unavailable_on
from ..runtime.timing import host_us, packed_runner, reference_us, time_all_us
from ..runtime.torch_ops import OP_FOR_FP8, torch_has_bsr_kernel
from . import fit as calib
from .work import priced_like, work

log = logging.getLogger("sparsecc")

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: the weight dtypes of quantized sites, and the format kinds their ops run
QUANTIZED_DTYPES = ("float8_e4m3fn",)
QUANTIZED_KINDS = tuple(OP_FOR_FP8)
#: M ranges of a plan's buckets (the last is open-ended)
BUCKETS = ((1, 1), (2, 16), (17, 128), (129, 1024), (1025, None))
DEFAULT_M = 128
#: BSR candidates are listed for blocks at most this dense (denser blocks cannot pay)
BSR_MAX_DENSITY = 0.6
#: ... and at most this many times the density of the sparsest block shape (a larger block
#: that stores twice the zeros of a smaller one does not pay)
BSR_DENSITY_SPREAD = 2.0
#: CSR is listed for weights at most this dense
CSR_MAX_DENSITY = 0.5
#: n:m patterns are listed when n/m is at most this
NM_MAX_RATIO = 0.5
#: a timed sparse choice must beat dense by this factor: on the GPU, whose graph-replay times
#: repeat within 2-3%, by 5%; on a shared CPU, whose timings are noisier, by 10%
MEASURED_MARGIN = {"cuda": 0.95, "cpu": 0.9}
#: the candidates predicted within this factor of the fastest (in every bucket) are timed ...
SHORTLIST_FACTOR = 1.5
#: ... at most this many of them (the fastest predicted first), dense besides
SHORTLIST_MAX = 3
#: a predicted sparse choice must beat dense by this factor in every bucket: predictions
#: are within about 25%, and a compiled model must never be slower than the dense one
DENSE_MARGIN = 0.9
#: ... and by this many microseconds: below it a kernel's launch latency, not its work, sets
#: the time, and the model cannot tell two such kernels apart (GPU: kernels of a few us)
MIN_GAIN_US = {"cuda": 1.5, "cpu": 10.0}
OBJECTIVES = ("latency", "memory")
#: the seconds a cost model spends timing candidates over all the sites of a plan, at most: the
#: sites timed first (in graph order) are decided by timing, the rest by the predictions (sites
#: alike share one timing, so a model of repeated layers rarely reaches it)
TIMING_BUDGET_S = {"cuda": 300.0, "cpu": 40.0}
#: on the CPU, the reference product of :meth:`CostModel.cpu_speed` is timed again after this many seconds
REFERENCE_EVERY_S = 10.0
#: a CPU timing during which the reference product ran this much slower than its fastest is taken again ...
BUSY_FACTOR = 1.25
#: ... at most this many times in all
TIMING_TRIES = 4
#: on the CPU, a timing whose fastest sparse candidate lands within this range of dense (a
#: close call, which one burst of other work can turn around) is taken again ...
CLOSE_CALL = (0.7, 1.25)
#: ... at most this many more times, each candidate keeping its fastest
CLOSE_CALL_RETIMES = 2

#: op by op on the GPU, the host time a call of a sparse site's op is taken to cost beyond
#: dense's where it is predicted, not timed: a 2:4 GEMM call (its CUTLASS arguments, tensor-map
#: descriptors and two launches) takes 24.5 us to issue on an H100 machine, torch's mm 12-13 us
PREDICTED_EXTRA_HOST_US = 15.0

#: numbers used where no calibration exists at all (rough H100 and laptop-CPU rates)
_FALLBACK_FITS = {
    "cuda": {"dense": calib.Fit(6.0, 600e12, 2.4e12, 4.0), "sparse24-gemm": calib.Fit(8.0, 450e12, 2.0e12, 4.0),
             "sparse24-gemv": calib.Fit(5.0, 50e12, 1.8e12, 4.0),
             "sparse24-mma": calib.Fit(5.0, 50e12, 1.8e12, 4.0), "nm-unpack": calib.Fit(20.0, 600e12, 1.5e12, 1.0),
             "bsr": calib.Fit(200.0, 60e12, 0.5e12, 2.0), "csr": calib.Fit(200.0, 3e12, 0.5e12, 2.0),
             "bsr-kernel": calib.Fit(8.0, 450e12, 6e12, 4.0),
             # (until a calibration measures it: the small-batch mma BSR kernel, by eye from
             # benchmarks/results/kernels_bsr_small-*-2026-11-26, an H200)
             "bsr-kernel-mma": calib.Fit(4.5, 400e12, 2.0e12, 8.0),
             "csr-kernel": calib.Fit(8.0, 250e12, 2.2e12, 4.0)},
    "cpu": {"dense": calib.Fit(10.0, 100e9, 20e9, 2.0), "nm-unpack": calib.Fit(20.0, 100e9, 10e9, 1.0),
            "bsr": calib.Fit(30.0, 30e9, 10e9, 2.0), "bsr-bmm": calib.Fit(60.0, 20e9, 10e9, 1.0),
            "csr": calib.Fit(30.0, 12e9, 10e9, 2.0)},
}


@dataclass
class Prediction:
    format: str
    us: float
    nbytes: int
    measured_us: float | None = None


@dataclass
class Decision:
    choice: FormatSpec
    reason: str
    candidates: list[Prediction]
    buckets: list[dict] = field(default_factory=list)
    above: str | None = None       # see SitePlan.above


def format_nbytes(stats: WeightStats, spec: FormatSpec, element_size: int, on_kernel: bool = False) -> int:
    """Bytes of ``spec``'s packed form for this weight (values plus indices); ``on_kernel``: in
    the layout of sparsecc's kernel (for CSR: 16-bit in-tile slots, counts padded to 8)."""
    n_rows, k = stats.shape
    if spec.kind == "dense":
        return stats.numel * element_size
    if spec.kind == "nm":
        kept = n_rows * math.ceil(k / spec.m) * spec.n
        return kept * (element_size + 1)
    if spec.kind == "bsr":
        h, w = spec.block
        blocks = round(stats.block_density[spec.block] * (n_rows // h) * (k // w))
        return blocks * (h * w * element_size + 4) + (n_rows // h + 1) * 4
    on_kernels = registry.packed_nbytes(spec, stats, element_size) if on_kernel else None
    if on_kernels is not None:
        return on_kernels
    return stats.nnz * (element_size + 4) + (n_rows + 1) * 4


def exact_candidates(stats: WeightStats, allowed: list[FormatSpec] | None) -> list[FormatSpec]:
    """Formats that represent the weight exactly: dense always, then the sparse ones listed by
    default (2:4 and the tightest sparse n:m per group size, BSR blocks at most 60% dense and
    at most twice as dense as the sparsest block shape, CSR at most 50% dense where 2:4 does not
    fit) or, with
    ``allowed``, those the restriction names."""
    found: list[FormatSpec] = [DENSE]
    if allowed is None:
        nm = [NM_2_4]
        sparsest = 0.5 if stats.fits(NM_2_4) else float("inf")
        for m, n in sorted(stats.nm_min_n.items()):     # list a pattern only if sparser than those before
            if 0 < n and n / m <= NM_MAX_RATIO and n / m < sparsest:
                nm.append(FormatSpec("nm", n=n, m=m))
                sparsest = n / m
        sparsest_block = min(stats.block_density.values(), default=1.0)
        bsr = [FormatSpec("bsr", block=b) for b, d in stats.block_density.items()
               if d <= BSR_MAX_DENSITY and d <= BSR_DENSITY_SPREAD * sparsest_block]
        # a weight that fits 2:4 runs as 2:4: CSR would run the same 2:4 kernels (split with no
        # residual) or slower ones, and a timing between equals only picks noise
        csr = [FormatSpec("csr")] if stats.density <= CSR_MAX_DENSITY and not stats.fits(NM_2_4) else []
        wanted = nm + bsr + csr
    else:
        wanted = []
        for restriction in allowed:
            if restriction.kind == "bsr" and restriction.block is None:
                wanted += [FormatSpec("bsr", block=b) for b in stats.block_density]
            elif restriction.kind != "dense":
                wanted.append(restriction)
    for spec in wanted:
        if spec not in found and stats.fits(spec):
            found.append(spec)
    return found


def representative_m(lo: int, hi: int | None) -> int:
    """The M a bucket is predicted at: its geometric middle (4 x lo for an open-ended one)."""
    return 4 * lo if hi is None else round(math.sqrt(lo * hi))


def buckets_for(m_range: tuple[int, int]) -> list[tuple[int, int, int]]:
    """``(lo, hi, representative M)`` of every bucket that meets ``m_range``, clipped to it."""
    lo, hi = m_range
    found = []
    for b_lo, b_hi in BUCKETS:
        b_hi = b_hi if b_hi is not None else max(hi, 4 * b_lo)
        c_lo, c_hi = max(lo, b_lo), min(hi, b_hi)
        if c_lo <= c_hi:
            found.append((c_lo, c_hi, representative_m(c_lo, c_hi)))
    return found


def check_m_range(m_range) -> tuple[int, int] | None:
    if m_range is None:
        return None
    try:
        lo, hi = (int(v) for v in m_range)
    except (TypeError, ValueError):
        raise InputError(f"m_range must be two integers (lo, hi), got {m_range!r}") from None
    if not 1 <= lo <= hi:
        raise InputError(f"m_range=({lo}, {hi}) needs 1 <= lo <= hi")
    return lo, hi


class CostModel:
    """Predicts and chooses (see the module docstring).

    ``calibration``: "auto" (this machine's, else the packaged one for the device type), a
    :class:`~sparsecc.planner.fit.Calibration`, or None (rough built-in numbers).
    ``measure``: time the shortlisted candidates and keep the fastest (None: yes).
    ``objective`` and ``max_slowdown``: see the module docstring.
    ``op_by_op``: the model's ops will run one by one from the host, not replayed from CUDA
    graphs; sparse candidates are charged their extra host time (module docstring).
    """

    def __init__(self, device: torch.device | str = "cpu", *, measure: bool | None = None,
                 calibration="auto", objective: str = "latency", max_slowdown: float = 1.1,
                 kernels_unavailable: str | None = "unset", op_by_op: bool = False):
        self.device = torch.device(device)
        self.op_by_op = bool(op_by_op)
        if objective not in OBJECTIVES:
            raise InputError(f"objective={objective!r}: use one of {OBJECTIVES}")
        if not max_slowdown >= 1.0:
            raise InputError(f"max_slowdown={max_slowdown!r} must be >= 1 (1.1 allows 10% slower than the fastest)")
        self.objective, self.max_slowdown = objective, float(max_slowdown)
        self.calibration = calib.for_device(self.device) if calibration == "auto" else calibration
        self._reference: tuple[float, float] | None = None     # (fastest reference_us seen, when last timed)
        self._timings: dict[tuple, object] = {}                 # site_timer's and dense_host_us', shared by sites alike
        #: seconds of timing this model may spend over a plan's sites; past it, predictions decide
        self.timing_budget_s = TIMING_BUDGET_S["cuda" if self.device.type == "cuda" else "cpu"]
        self.timing_spent_s = 0.0
        self.measure = True if measure is None else bool(measure)
        if kernels_unavailable == "unset":
            kernels_unavailable = kernels_unavailable_on(self.device)
        #: why sparsecc's own kernels cannot run here (None: they can)
        self.kernels_unavailable = kernels_unavailable

    @property
    def source(self) -> str:
        """Where the numbers come from, for the plan's reasons."""
        if self.calibration is None:
            return "built-in estimates (no calibration)"
        return f"calibration of {self.calibration.device}" + (" (borrowed)" if self.calibration.borrowed else "")

    def uses_kernel(self, stats: WeightStats, spec: FormatSpec) -> bool:
        """Whether ``spec`` runs on a generated kernel for this weight (2:4, BSR and CSR on Hopper)."""
        return self.kernels_unavailable is None and self._kernel_refuses(stats, spec) is None

    @staticmethod
    def _kernel_refuses(stats: WeightStats, spec: FormatSpec) -> str | None:
        """Why sparsecc's kernels cannot run ``spec`` for this weight's shape and dtype, or None."""
        return registry.refusal(spec, stats.shape, getattr(torch, stats.dtype))

    def cpu_speed(self) -> float:
        """On the CPU, how much slower than at calibration this machine runs now: the fastest
        :func:`~sparsecc.runtime.timing.reference_us` this model has seen (timed again at most every
        :data:`REFERENCE_EVERY_S`) over the calibration's, within [0.5, 2]; 1 on the GPU or
        for a calibration without a reference. A borrowed calibration is scaled to this CPU."""
        if self.device.type != "cpu" or self.calibration is None or not self.calibration.reference_us:
            return 1.0
        if self._reference is None or time.monotonic() - self._reference[1] > REFERENCE_EVERY_S:
            self._time_reference()
        return min(2.0, max(0.5, self._reference[0] / self.calibration.reference_us))

    def _time_reference(self) -> float:
        """Time :func:`~sparsecc.runtime.timing.reference_us` now, keep the fastest seen (and when), return this timing."""
        now = reference_us()
        self._reference = min(now, self._reference[0]) if self._reference else now, time.monotonic()
        return now

    def _timed_quietly(self, measure):
        """``measure()``, on the CPU taken while the machine runs at its usual speed: the
        reference product is timed before and after, and a measurement during which it ran
        :data:`BUSY_FACTOR` slower than the fastest seen is taken again (at most
        :data:`TIMING_TRIES` times). On a 2-core machine a burst of other work stalls a
        2-thread product (torch's dense GEMM) but not a 1-thread one (its sparse kernels),
        which would tilt the comparison."""
        if self.device.type != "cpu":
            return measure()
        for _ in range(TIMING_TRIES):
            before = self._time_reference()
            measured = measure()
            after = self._time_reference()
            if max(before, after) <= BUSY_FACTOR * self._reference[0]:
                break
            time.sleep(0.05)
        return measured

    def _timed_settled(self, measure) -> dict:
        """:meth:`_timed_quietly` of ``measure()``; on the CPU a close call between dense and
        the fastest sparse candidate (:data:`CLOSE_CALL`) is timed again, up to
        :data:`CLOSE_CALL_RETIMES` more times, each candidate keeping its fastest."""
        measured = self._timed_quietly(measure)
        for _ in range(CLOSE_CALL_RETIMES if self.device.type == "cpu" else 0):
            dense, sparse = None, []
            for spec, us in measured.items():
                if FormatSpec.parse(str(spec)).kind == "dense":
                    dense = us
                else:
                    sparse.append(us)
            if dense is None or not sparse or not CLOSE_CALL[0] <= min(sparse) / dense <= CLOSE_CALL[1]:
                break
            again = self._timed_quietly(measure)
            measured = {s: min(us, again.get(s, us)) for s, us in measured.items()}
        return measured

    def workloads(self, stats: WeightStats, spec: FormatSpec, m: int,
                  planned_m: int | None = None) -> list[list[Workload]]:
        """The work of ``spec`` at ``m`` rows for a site packed for ``planned_m`` rows: one list of
        :class:`Workload` (summed) per way it may run. On sparsecc's kernels one per kernel family
        the site may be packed for (CSR: compile times them on the weight and packs the fastest),
        else torch's path."""
        planned_m = planned_m if planned_m is not None else m
        n, k = stats.shape
        if self.uses_kernel(stats, spec):
            found = [family.workloads(stats, spec, m, planned_m)
                     for family in registry.candidates(spec, getattr(torch, stats.dtype), stats.shape, planned_m)]
            return [w for w in found if w]
        fields = dict(dtype=stats.dtype, m=m, n=n, k=k, density=round(stats.density, 6))
        if spec.kind == "dense":
            return [[Workload("dense", **fields)]]
        if spec.kind == "nm":
            return [[Workload("nm-unpack", **{**fields, "density": spec.n / spec.m})]]
        if spec.kind == "bsr":
            compute = torch.float32 if stats.dtype in ("float16", "bfloat16") else getattr(torch, stats.dtype)
            impl = "bsr" if torch_has_bsr_kernel(self.device, compute, spec.block) else "bsr-bmm"
            return [[Workload(impl, **fields, block=spec.block,
                              block_density=round(stats.block_density[spec.block], 6))]]
        return [[Workload("csr", **fields)]]

    def workload(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None = None) -> Workload:
        """The first workload of :meth:`workloads` (what a calibration probe records)."""
        return self.workloads(stats, spec, m, planned_m)[0][0]

    def predict_us(self, stats: WeightStats, spec: FormatSpec, m: int, planned_m: int | None = None) -> float:
        """The predicted time of ``spec`` at ``m`` rows for a site packed for ``planned_m`` rows:
        the fastest of the ways it may run (see :meth:`workloads`)."""
        return min(sum(self._predict_workload(w) for w in ways) for ways in self.workloads(stats, spec, m, planned_m))

    def _predict_workload(self, w: Workload) -> float:
        if self.calibration is not None:
            predicted = self.calibration.predict_us(w)
            if predicted is not None:
                return predicted * self.cpu_speed()
        like = priced_like(w.impl)
        if like is not None:           # e.g. a residual pass: its bytes at the dense fit's bandwidth
            fit = (self.calibration.fit_for(like, w.dtype) if self.calibration is not None else None)
            return (fit or self._fallback_fit(like)).predict_us(*work(w))
        return self._fallback_fit(w.impl).predict_us(*work(w))

    def _fallback_fit(self, impl: str) -> calib.Fit:
        fits = _FALLBACK_FITS["cuda" if self.device.type == "cuda" else "cpu"]
        return fits.get(impl, fits["dense"])

    def decide(self, stats: WeightStats, m: int | None, allowed: list[FormatSpec] | None,
               measure_sites=None, m_range: tuple[int, int] | None = None) -> Decision:
        """Choose a format for one site seen with ``m`` rows (None: not observed), over
        ``m_range`` if given. ``measure_sites(specs, m, planned_m) -> {spec: us}`` times
        candidates against one another (:meth:`site_timer`)."""
        if stats.dtype in QUANTIZED_DTYPES:
            return self._decide_quantized(stats, allowed)
        if stats.dtype not in SUPPORTED_DTYPES:
            return Decision(DENSE, f"dtype {stats.dtype} is not supported (only {', '.join(SUPPORTED_DTYPES)}); "
                                   "stays dense", [])
        m_range = check_m_range(m_range)
        m_used = m or DEFAULT_M
        declared = m_range or (m_used, m_used)
        planned_m = declared[1]
        ranges = buckets_for(declared)
        where = (f"M in {declared[0]}..{declared[1]}" if m_range else
                 f"M={m_used}" + ("" if m else " (M not observed; assumed)"))
        candidates = exact_candidates(stats, allowed)
        element = torch.empty((), dtype=getattr(torch, stats.dtype)).element_size()
        times = {s: [self.predict_us(stats, s, rep, planned_m) + self._extra_host_us(s) for _, _, rep in ranges]
                 for s in candidates}
        at_m = ranges[-1][2]            # the example's M, or the declared range's largest bucket
        predictions = [Prediction(str(s), times[s][-1], format_nbytes(stats, s, element, self.uses_kernel(stats, s)))
                       for s in candidates]
        best_per_bucket = [min(t[i] for t in times.values()) for i in range(len(ranges))]
        worst_ratio = {s: max(t[i] / best_per_bucket[i] for i in range(len(ranges))) for s, t in times.items()}
        tiers = self._small_batch_tiers(stats, candidates, declared)
        for spec, tier in tiers.items():    # it may run the low end only: shortlisted by what it runs there
            worst_ratio[spec] = min(worst_ratio[spec], self._by_rows_ratio(stats, spec, tier, ranges, times,
                                                                           best_per_bucket))
        buckets = [self._bucket(stats, candidates, lo, hi, rep, planned_m, declared) for lo, hi in BUCKETS
                   for rep in [representative_m(lo, hi)]]
        forced = allowed is not None and not any(s.kind == "dense" for s in allowed)
        pool = [s for s in candidates if not (forced and s.kind == "dense")]
        if not forced and self.objective == "latency":
            # n:m on torch unpacks to dense and then runs the dense product: never faster than
            # dense, so only timing noise could pick it for speed (it stays a memory candidate)
            pool = [s for s in pool if not (s.kind == "nm" and self.workload(stats, s, m_used).impl == "nm-unpack")]
        if not pool:
            names = ", ".join(str(s) for s in allowed)
            return Decision(DENSE, f"formats=({names}): the weight fits none of them exactly; stays dense",
                            predictions, buckets)
        by_name = {p.format: p for p in predictions}
        if forced:
            spec = min(pool, key=lambda s: worst_ratio[s])
            return Decision(spec, f"formats restricts the choice to {[str(s) for s in allowed]}; {spec} fits "
                                  f"exactly (predicted {by_name[str(spec)].us:.1f} us at M={at_m})"
                                  + self._where_it_runs(stats, spec, planned_m), predictions, buckets)
        shortlist = sorted((s for s in pool if worst_ratio[s] <= SHORTLIST_FACTOR), key=worst_ratio.get)
        shortlist = list(dict.fromkeys([*shortlist[:SHORTLIST_MAX], DENSE]))
        timing = self.measure and measure_sites is not None and self.objective == "latency" and len(shortlist) > 1
        over_budget = timing and self.timing_spent_s >= self.timing_budget_s
        if timing and not over_budget:
            start = time.perf_counter()
            measured = self._timed_settled(lambda: measure_sites(shortlist, at_m, planned_m))
            tiers = {spec: tier for spec, tier in tiers.items() if spec in shortlist}
            low = declared[0]
            low_measured = self._timed_settled(lambda: measure_sites(shortlist, low, low)) if tiers else {}
            self.timing_spent_s += time.perf_counter() - start
            decision = self._choose_by_timing(stats, shortlist, times, predictions, buckets, measured, at_m, where,
                                              planned_m)
            return self._with_small_batches(decision, tiers, low, low_measured) if tiers else decision
        spec, why = self._choose(pool, times, worst_ratio, predictions)
        budget = (f"; not timed: this plan's timing budget of {self.timing_budget_s:g} s is spent"
                  if over_budget else "")
        return Decision(spec, f"{why}{self._where_it_runs(stats, spec, planned_m)} at {where} ({self.source})"
                              f"{budget}", predictions, buckets)

    def _decide_quantized(self, stats: WeightStats, allowed: list[FormatSpec] | None) -> Decision:
        """A quantized site's format (see the module docstring): dense, or the n:m format that
        ``allowed`` names and the weight fits. Nothing is predicted or timed (the FP8 2:4 GEMM is
        not calibrated yet): no candidate is listed with a time."""
        fitting = [s for s in exact_candidates(stats, allowed) if s.kind in QUANTIZED_KINDS]
        forced = allowed is not None and not any(s.kind == "dense" for s in allowed)
        sparse = [s for s in fitting if s.kind != "dense"]
        if forced and sparse:
            spec = sparse[0]
            runs = self._quantized_runs_on(stats, spec)
            return Decision(spec, f"FP8 site: formats asks for {spec}, which the weight fits exactly; {runs}; "
                                  "it computes what the dense FP8 site computes", [])
        if forced:
            names = ", ".join(str(s) for s in allowed)
            return Decision(DENSE, f"FP8 site: formats=({names}): none fits the weight exactly or has an FP8 op "
                                   f"({', '.join(QUANTIZED_KINDS)}); stays dense", [])
        family, not_there = registry.quantized_dense(stats.shape, self.device)
        where = (f"runs on {family.unit} for the input dtypes it takes here (others on its reference op)" if family
                 else f"runs on its reference op ({not_there})")
        return Decision(DENSE, f"FP8 site: stays dense, {where}; formats=('2:4',) packs a 2:4 weight (same "
                               "results)", [])

    def _quantized_runs_on(self, stats: WeightStats, spec: FormatSpec) -> str:
        """Where a quantized site packed as ``spec`` runs, for its plan's reason."""
        if self.uses_kernel(stats, spec):
            family = registry.candidates(spec, getattr(torch, stats.dtype), stats.shape, None)[0]
            return f"runs on {family.unit} for fp16/bf16 inputs"
        why = self.kernels_unavailable or self._kernel_refuses(stats, spec)
        return f"runs on its reference op ({why})"

    def _extra_host_us(self, spec: FormatSpec) -> float:
        """What a predicted sparse candidate is charged for its host time (see the module docstring)."""
        charged = self.op_by_op and self.device.type == "cuda" and spec.kind != "dense"
        return PREDICTED_EXTRA_HOST_US if charged else 0.0

    def _choose_by_timing(self, stats, shortlist, times, predictions, buckets, measured, at_m, where,
                          planned_m) -> Decision:
        """The choice by timing (see the module docstring): the fastest of the shortlist."""
        measured = {FormatSpec.parse(str(s)): us for s, us in measured.items()}
        for p in predictions:
            p.measured_us = measured.get(FormatSpec.parse(p.format))
        spec = min(measured, key=measured.get)
        timed = ", ".join(f"{s} {measured[s]:.1f}" for s in sorted(measured, key=measured.get))
        host = "; op by op: each sparse time includes its host time beyond dense's" if self.charges_host() else ""
        why = (f"timed here at M={at_m} (us{host}): {timed}; predicted ({self.source}): "
               + ", ".join(f"{s} {times[s][-1]:.1f}" for s in shortlist) + f"; at {where}")
        margin = MEASURED_MARGIN["cuda" if self.device.type == "cuda" else "cpu"]
        if spec.kind != "dense" and measured[spec] > margin * measured[DENSE]:
            return Decision(DENSE, f"dense stays: {spec} was timed fastest but not {1 - margin:.0%} "
                                   f"ahead of dense; {why}", predictions, buckets)
        return Decision(spec, f"{spec} was timed fastest{self._where_it_runs(stats, spec, planned_m)}; {why}",
                        predictions, buckets)

    def _small_batch_tiers(self, stats: WeightStats, shortlist,
                           declared: tuple[int, int]) -> dict[FormatSpec, tuple[str, int]]:
        """The sparse formats among ``shortlist`` that would run the low end of a declared range on
        kernels of their own, with the dense weight or other kernels above
        (:func:`~sparsecc.kernels.registry.small_batch_tier`: 2:4's small-batch kernels, BSR's): how
        the plan names those kernels and the most rows they run. The shortlist is timed there too."""
        if declared[0] == declared[1]:
            return {}
        tiers = {}
        for spec in shortlist:
            if spec.kind != "dense" and self.uses_kernel(stats, spec):
                tier = registry.small_batch_tier(spec, getattr(torch, stats.dtype), stats.shape, *declared)
                if tier is not None:
                    tiers[spec] = tier
        return tiers

    def _by_rows_ratio(self, stats: WeightStats, spec: FormatSpec, tier: tuple[str, int], ranges, times,
                       best_per_bucket) -> float:
        """For ``spec`` with a low-end ``tier`` over the range, the worst ratio to the fastest
        prediction of ``spec`` run by rows: its kernels predicted in the buckets the tier serves,
        dense above (the top's prediction may be far off dense while the low end wins)."""
        limit, host = tier[1], self._extra_host_us(spec)
        ratios = [(self.predict_us(stats, spec, rep, rep) + host if rep <= limit else times[DENSE][i])
                  / best_per_bucket[i] for i, (_, _, rep) in enumerate(ranges)]
        return max(1.0, max(ratios))

    def _with_small_batches(self, decision: Decision, tiers: dict[FormatSpec, tuple[str, int]], low: int,
                            low_measured: dict) -> Decision:
        """``decision`` (made at the top of the range) with what the timing at its low end adds:
        where the fastest there of the formats with a low-end tier (``tiers``) beat dense by the
        margin, the site runs that format up to the rows of its tier, and above them the same
        format (2:4: on its GEMMs) if it was chosen at the top, else the dense weight
        (``above="dense"``)."""
        measured = {FormatSpec.parse(str(s)): us for s, us in low_measured.items()}
        dense = measured.get(DENSE)
        timed = {spec: measured[spec] for spec in tiers if spec in measured}
        if dense is None or not timed:
            return decision
        spec = min(timed, key=timed.get)
        unit, limit = tiers[spec]
        note = f"at M={low}, the range's low end, {spec} on {unit} timed {timed[spec]:.1f} us, dense {dense:.1f} us"
        margin = MEASURED_MARGIN["cuda" if self.device.type == "cuda" else "cpu"]
        if timed[spec] > margin * dense or decision.choice not in (spec, DENSE):
            return dataclasses.replace(decision, reason=f"{decision.reason}; {note}")
        if decision.choice == spec:
            above = f": up to M={limit} on it, above on the GEMMs" if spec == NM_2_4 else ""
            return dataclasses.replace(decision, reason=f"{decision.reason}; {note}{above}")
        return Decision(spec, f"{spec} up to M={limit}, dense above: {note}; above M={limit}: {decision.reason}",
                        decision.candidates, decision.buckets, above=ABOVE_DENSE)

    def prices_groups(self) -> bool:
        """Whether sibling sites are also planned as one (:mod:`sparsecc.planner.groups`): where
        candidates are timed on the GPU for speed."""
        return self.device.type == "cuda" and self.measure and self.objective == "latency"

    def charges_host(self) -> bool:
        """Whether sparse candidates are charged their host time beyond dense's (op by op on the GPU)."""
        return self.op_by_op and self.device.type == "cuda"

    def dense_host_us(self, weight: torch.Tensor, m: int) -> float:
        """The host microseconds of one dense call of ``weight`` at ``m`` rows, as Inductor's code
        makes it (:func:`host_times`); timed once per shape, dtype and rows, so that layers alike
        are weighed alike (as :meth:`site_timer` shares its timings)."""
        key = ("dense-host", tuple(weight.shape), weight.dtype, weight.device, m)
        if key not in self._timings:
            self._timings[key] = host_times(weight, m, {})[DENSE]
        return self._timings[key]

    def site_timer(self, weight: torch.Tensor, stats: WeightStats, epilogue: Epilogue | None = None):
        """The ``measure_sites`` of :meth:`decide` for one site: times its candidates on
        ``weight`` as compile would pack and run them (sparsecc's kernels where they take it),
        with the site's ``epilogue`` (bias, activation).
        Where no candidate's time depends on the weight's values (dense, and 2:4 on sparsecc's
        kernels), a site takes the times measured on an earlier one of the same shape, dtype
        and batch: the layers of a model then get one decision, in one timing, not one each
        (timings within noise of the margin flipped identical layers either way)."""
        def measure(specs, m, planned_m):
            on_kernel = {s: self.uses_kernel(stats, s) for s in specs}
            key = _value_free_key(weight, specs, on_kernel, m, planned_m)
            key = key and (*key, str(epilogue or Epilogue()))
            if key is not None and key in self._timings:
                return dict(self._timings[key])
            timed = time_sites(weight, specs, m, on_kernel=on_kernel, planned_m=planned_m,
                               host=self.charges_host(), epilogue=epilogue)
            if key is not None:
                self._timings[key] = dict(timed)
            return timed
        return measure

    def _where_it_runs(self, stats: WeightStats, spec: FormatSpec, planned_m: int | None = None) -> str:
        """For a sparse choice on the GPU, the part of the reason that says which code runs it
        (for 2:4, also the small-batch kernel that takes the planned batch, where one does)."""
        if spec.kind not in ("nm", "bsr", "csr") or self.device.type != "cuda":
            return ""
        if self.uses_kernel(stats, spec):
            families = registry.candidates(spec, getattr(torch, stats.dtype), stats.shape, planned_m)
            if len(families) > 1:
                return "; runs on " + ", ".join(f.unit for f in families) + ": whichever times fastest on the weight"
            family = families[0]
            beyond = " (at larger batches too, slower than the GEMMs there)" if family.max_m is not None else ""
            return f"; runs on {family.unit}{beyond}"
        return f"; on torch, not sparsecc's kernel: {self.kernels_unavailable or self._kernel_refuses(stats, spec)}"

    def _choose(self, pool, times, worst_ratio, predictions) -> tuple[FormatSpec, str]:
        """The objective's choice among ``pool`` and the first part of the reason."""
        dense_times = times[DENSE]

        min_gain = MIN_GAIN_US["cuda" if self.device.type == "cuda" else "cpu"]

        def clears_dense(s):       # in every bucket, far enough ahead of dense to trust the prediction
            return s.kind == "dense" or all(t <= DENSE_MARGIN * d and d - t >= min_gain
                                            for t, d in zip(times[s], dense_times))

        def summary(s):
            return " / ".join(f"{t:.1f}" for t in times[s]) + " us"

        trusted = [s for s in pool if clears_dense(s)]
        fastest = min(pool, key=lambda s: worst_ratio[s])
        if self.objective == "memory":
            nbytes = {p.format: p.nbytes for p in predictions}
            within = [s for s in pool if worst_ratio[s] <= self.max_slowdown] or [DENSE]
            spec = min(within, key=lambda s: (nbytes[str(s)], worst_ratio[s]))
            return spec, (f"{spec} is the smallest ({nbytes[str(spec)]} bytes) of the formats predicted within "
                          f"{self.max_slowdown:g}x of the fastest: {summary(spec)}")
        spec = min(trusted, key=lambda s: worst_ratio[s])
        if spec.kind == "dense":
            if fastest.kind == "dense":
                unpacked = [str(s) for s in times if s.kind != "dense" and s not in pool]
                others = ", ".join(f"{s} {summary(s)}" for s in pool if s.kind != "dense") or (
                    f"{', '.join(unpacked)} would run unpacked to dense on torch: a memory candidate only"
                    if unpacked else "no sparse format fits")
                return spec, f"dense is fastest: {summary(spec)} ({others})"
            return spec, (f"dense stays: {fastest} is predicted at {summary(fastest)} vs dense {summary(spec)}, "
                          f"not the {1 - DENSE_MARGIN:.0%} and {min_gain:g} us ahead a sparse choice needs")
        return spec, f"{spec} is the fastest exact format: {summary(spec)} vs dense {summary(DENSE)}"

    def _bucket(self, stats, candidates, lo, hi, m, planned_m, declared) -> dict:
        times = {str(s): round(self.predict_us(stats, s, m, planned_m), 3) for s in candidates}
        inside = declared[0] <= (hi or math.inf) and lo <= declared[1]
        return {"m_lo": lo, "m_hi": hi, "m": m, "predicted_us": times, "best": min(times, key=times.get),
                "declared": inside}


def _value_free_key(weight: torch.Tensor, specs, on_kernel: dict, m: int, planned_m: int | None) -> tuple | None:
    """What the times of ``specs`` on ``weight`` depend on, when not on its values: dense, 2:4 on
    sparsecc's kernels and n:m on torch (unpacked, then a dense product) cost the same for every
    weight of one shape and dtype (BSR and CSR depend on where the non-zeros are). None otherwise."""
    if not all(s.kind in ("dense", "nm") for s in specs):
        return None
    return (tuple(weight.shape), weight.dtype, str(weight.device), m, planned_m,
            tuple((str(s), bool(on_kernel.get(s))) for s in specs))


def time_sites(weight: torch.Tensor, specs: list[FormatSpec], m: int, *, on_kernel: dict | None = None,
               planned_m: int | None = None, host: bool = False,
               epilogue: Epilogue | None = None) -> dict[FormatSpec, float]:
    """Microseconds per call of the site's op for each format in ``specs`` on random inputs
    with ``m`` rows and ``epilogue``'s bias and activation, timed against one another
    (:func:`sparsecc.runtime.timing.time_all_us`); a format
    ``on_kernel`` maps to True is packed for sparsecc's kernels, for ``planned_m`` rows. ``host``
    (on the GPU): each sparse format's time also counts the host time its call takes beyond
    dense's (:func:`sparsecc.runtime.timing.host_us`), as a model run op by op pays it."""
    on_kernel = on_kernel or {}
    runners = {}
    for spec in specs:
        try:
            runners[spec] = site_runner(weight, spec, m, on_kernel=on_kernel.get(spec, False), planned_m=planned_m,
                                        epilogue=epilogue)
        except (SparseccError, RuntimeError) as error:     # e.g. its kernels failed to build: not timed, not chosen
            if spec == DENSE:
                raise
            log.warning("sparsecc: %s is left out of the timing: %s", spec, str(error).splitlines()[0])
    timed = time_all_us(runners, weight.device)
    if not host or weight.device.type != "cuda" or DENSE not in runners:
        return timed
    return with_host_time(timed, host_times(weight, m, runners))


def host_times(weight: torch.Tensor, m: int, runners: dict) -> dict[FormatSpec, float]:
    """Host microseconds per call of each format as a model run op by op pays them
    (:func:`~sparsecc.runtime.timing.host_us`): a sparse format's op call, and for dense the one
    matrix product Inductor's code calls for a dense site (its bias and activation fuse into the
    neighbouring kernels). Timing dense through its runner, sparsecc's portable op with the
    epilogue, would put it at twice that and hide what a sparse op's call adds."""
    x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
    w = weight.detach()
    issued = {spec: host_us(run) for spec, run in runners.items() if spec != DENSE}
    issued[DENSE] = host_us(lambda: torch.mm(x, w.t()))
    return issued


def with_host_time(timed: dict[FormatSpec, float], issued: dict[FormatSpec, float]) -> dict[FormatSpec, float]:
    """Each sparse format's time plus the host time its call takes (``issued``) beyond dense's."""
    return {spec: us + (max(0.0, issued[spec] - issued[DENSE]) if spec != DENSE else 0.0)
            for spec, us in timed.items()}


def site_runner(weight: torch.Tensor, spec: FormatSpec, m: int, *, on_kernel: bool = False,
                planned_m: int | None = None, epilogue: Epilogue | None = None):
    """A no-argument function computing ``x @ W^T`` for random ``x`` with ``m`` rows, with
    ``weight`` packed in ``spec`` as compile would pack it: for sparsecc's kernels when
    ``on_kernel`` (for a site planned at ``planned_m`` rows, else ``m``), else in the portable
    layout, and ``epilogue``'s bias and activation (:func:`sparsecc.runtime.timing.packed_runner`)."""
    if on_kernel:
        packed = registry.pack(weight, spec, planned_m if planned_m is not None else m, tune_range=(m, m))
    else:
        packed = pack(weight, spec)
    return packed_runner(packed, m, weight.device, on_kernel=on_kernel, epilogue=epilogue)
