"""Cost model v0: predicted time of every exact candidate format for a site, and a choice.

The prediction is a roofline per implementation: ``overhead + max(flops / rate, bytes /
bandwidth)``, with rates for the kernels sparsecc would run on that device (see
:data:`PROFILES`). The numbers are deliberately conservative for the sparse paths that run
on torch's own kernels, whose efficiency varies most. On the CPU, a sparse choice is kept only
after it was measured faster than dense on the site's own shape, so sparsecc never picks CSR
on a CPU where it would lose.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .analysis import WeightStats
from .formats import DENSE, NM_2_4, FormatSpec, pack
from .ops import OP_FOR_KIND

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: M ranges of a plan's buckets (the last is open-ended)
BUCKETS = ((1, 16), (17, 128), (129, 1024), (1025, None))
DEFAULT_M = 128
#: BSR candidates are listed for blocks at most this dense (denser blocks cannot pay)
BSR_MAX_DENSITY = 0.6
#: CSR is listed for weights at most this dense
CSR_MAX_DENSITY = 0.5
#: n:m patterns are listed when n/m is at most this
NM_MAX_RATIO = 0.5
#: a measured sparse choice must beat dense by this factor (timings on a busy CPU are noisy)
MEASURED_MARGIN = 0.9
#: fraction of the 2x sparse tensor-core rate sparsecc's 2:4 kernel is assumed to reach
SPARSE24_EFFICIENCY = 0.7


@dataclass(frozen=True)
class KernelRate:
    """One implementation's throughput: useful flop/s, bandwidth it reaches, fixed cost."""

    flops: float
    bandwidth: float
    overhead_us: float


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    dense: dict[str, KernelRate]
    sparse: dict[str, KernelRate]        # "nm" (unpack + dense), "bsr", "csr"
    measure_sparse_choice: bool = False  # confirm a sparse choice by timing it


_CPU = DeviceProfile(
    name="cpu",
    dense={"float32": KernelRate(100e9, 20e9, 10.0), "bfloat16": KernelRate(50e9, 20e9, 10.0),
           "float16": KernelRate(20e9, 20e9, 10.0)},
    sparse={"nm": KernelRate(100e9, 10e9, 20.0), "bsr": KernelRate(30e9, 10e9, 30.0),
            "csr": KernelRate(12e9, 10e9, 30.0)},
    measure_sparse_choice=True,
)
_CUDA = DeviceProfile(
    name="cuda",
    dense={"float32": KernelRate(50e12, 2.4e12, 6.0), "bfloat16": KernelRate(600e12, 2.4e12, 6.0),
           "float16": KernelRate(600e12, 2.4e12, 6.0)},
    # torch's own CUDA sparse paths (cuSPARSE CSR, Triton BSR; n:m unpacks then runs dense):
    # rates from measurements on an H100 (shared/reference/anchors-hopper.txt).
    sparse={"nm": KernelRate(600e12, 0.8e12, 12.0), "bsr": KernelRate(120e12, 1.0e12, 450.0),
            "csr": KernelRate(3e12, 0.5e12, 20.0)},
)
PROFILES = {"cpu": _CPU, "cuda": _CUDA}


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


def format_nbytes(stats: WeightStats, spec: FormatSpec, element_size: int) -> int:
    """Bytes of ``spec``'s packed form for this weight (values plus indices)."""
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
    return stats.nnz * (element_size + 4) + (n_rows + 1) * 4


def exact_candidates(stats: WeightStats, allowed: list[FormatSpec] | None) -> list[FormatSpec]:
    """Formats that represent the weight exactly: dense always, then the sparse ones listed by
    default (2:4 and the tightest sparse n:m per group size, BSR blocks at most 60% dense, CSR
    at most 50% dense) or, with ``allowed``, those the restriction names."""
    found: list[FormatSpec] = [DENSE]
    if allowed is None:
        nm = [NM_2_4]
        sparsest = 0.5 if stats.fits(NM_2_4) else float("inf")
        for m, n in sorted(stats.nm_min_n.items()):     # list a pattern only if sparser than those before
            if 0 < n and n / m <= NM_MAX_RATIO and n / m < sparsest:
                nm.append(FormatSpec("nm", n=n, m=m))
                sparsest = n / m
        bsr = [FormatSpec("bsr", block=b) for b, d in stats.block_density.items() if d <= BSR_MAX_DENSITY]
        csr = [FormatSpec("csr")] if stats.density <= CSR_MAX_DENSITY else []
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


class CostModel:
    """Predicts and chooses. ``measure=False`` turns off the CPU confirmation timing (for
    reproducible plans)."""

    def __init__(self, device: torch.device | str = "cpu", *, measure: bool = True,
                 kernels_unavailable: str | None = "unset"):
        self.device = torch.device(device)
        self.profile = PROFILES["cuda" if self.device.type == "cuda" else "cpu"]
        self.measure = measure and self.profile.measure_sparse_choice
        if kernels_unavailable == "unset":
            from .gpu import kernels_unavailable as why_not
            kernels_unavailable = why_not(self.device)
        #: why sparsecc's own kernels cannot run here (None: they can)
        self.kernels_unavailable = kernels_unavailable

    def uses_kernel(self, stats: WeightStats, spec: FormatSpec) -> bool:
        """Whether ``spec`` runs on a generated kernel for this weight (2:4 on Hopper)."""
        from .gpu import shape_supported
        return (self.kernels_unavailable is None and spec == FormatSpec("nm", n=2, m=4)
                and shape_supported(*stats.shape, getattr(torch, stats.dtype)) is None)

    def predict_us(self, stats: WeightStats, spec: FormatSpec, m: int) -> float:
        n_rows, k = stats.shape
        element = torch.empty((), dtype=getattr(torch, stats.dtype)).element_size()
        activation_bytes = (m * k + m * n_rows) * element
        if spec.kind == "dense":
            rate = self.profile.dense.get(stats.dtype, self.profile.dense["float32"])
            flops = 2.0 * m * n_rows * k
        else:
            if self.uses_kernel(stats, spec):     # sparse tensor cores: twice the math, 9/16 the bytes
                dense_rate = self.profile.dense[stats.dtype]
                flops = 2.0 * m * n_rows * k / (2 * SPARSE24_EFFICIENCY)
                nbytes = stats.numel * element * 9 // 16 + activation_bytes
                return dense_rate.overhead_us + max(flops / dense_rate.flops, nbytes / dense_rate.bandwidth) * 1e6
            rate = self.profile.sparse[spec.kind]
            if spec.kind == "nm":     # unpacked to dense on every call, then a dense product
                unpack_bytes = 3 * stats.numel * element
                return self.predict_us(stats, DENSE, m) + rate.overhead_us + unpack_bytes / rate.bandwidth * 1e6
            useful = stats.nnz if spec.kind == "csr" else stats.block_density[spec.block] * stats.numel
            flops = 2.0 * m * useful
        nbytes = format_nbytes(stats, spec, element) + activation_bytes
        return rate.overhead_us + max(flops / rate.flops, nbytes / rate.bandwidth) * 1e6

    def decide(self, stats: WeightStats, m: int | None, allowed: list[FormatSpec] | None,
               measure_site=None) -> Decision:
        """Choose a format for one site. ``measure_site(spec, m) -> us`` times a candidate."""
        m_used = m or DEFAULT_M
        if stats.dtype not in SUPPORTED_DTYPES:
            return Decision(DENSE, f"dtype {stats.dtype} is not supported (only {', '.join(SUPPORTED_DTYPES)}); "
                                   "stays dense", [])
        candidates = exact_candidates(stats, allowed)
        element = torch.empty((), dtype=getattr(torch, stats.dtype)).element_size()
        predictions = [Prediction(str(s), self.predict_us(stats, s, m_used), format_nbytes(stats, s, element))
                       for s in candidates]
        buckets = [self._bucket(stats, candidates, lo, hi) for lo, hi in BUCKETS]
        at = f"at M={m_used}" + ("" if m else " (M not observed; assumed)")
        forced = allowed is not None and not any(s.kind == "dense" for s in allowed)
        pool = [(s, p) for s, p in zip(candidates, predictions) if not (forced and s.kind == "dense")]
        if not pool:
            names = ", ".join(str(s) for s in allowed)
            return Decision(DENSE, f"formats=({names}): the weight fits none of them exactly; stays dense",
                            predictions, buckets)
        spec, best = min(pool, key=lambda sp: sp[1].us)
        if spec.kind == "nm" and self.device.type == "cuda":
            at += ("; runs on sparsecc's sm90 2:4 CUTLASS kernel" if self.uses_kernel(stats, spec) else
                   f"; on torch, not sparsecc's kernel: {self.kernels_unavailable or 'the shape does not fit it'}")
        if forced:
            return Decision(spec, f"formats restricts the choice to {[str(s) for s in allowed]}; "
                                  f"{spec} fits exactly (predicted {best.us:.1f} us {at})", predictions, buckets)
        dense = predictions[0]
        if spec.kind == "dense":
            others = ", ".join(f"{p.format} {p.us:.1f}" for p in predictions[1:]) or "no sparse format fits"
            return Decision(DENSE, f"dense is fastest {at}: {dense.us:.1f} us ({others})", predictions, buckets)
        if self.measure and measure_site is not None:
            best.measured_us, dense.measured_us = measure_site(spec, m_used), measure_site(DENSE, m_used)
            if best.measured_us >= MEASURED_MARGIN * dense.measured_us:
                return Decision(DENSE, f"{spec} was predicted faster but measured slower on {self.device.type} "
                                       f"{at} ({best.measured_us:.1f} vs dense {dense.measured_us:.1f} us); "
                                       "stays dense", predictions, buckets)
            return Decision(spec, f"{spec} measured faster on {self.device.type} {at}: {best.measured_us:.1f} us "
                                  f"vs dense {dense.measured_us:.1f} us", predictions, buckets)
        return Decision(spec, f"{spec} is the fastest exact format {at}: {best.us:.1f} us vs dense "
                              f"{dense.us:.1f} us", predictions, buckets)

    def _bucket(self, stats, candidates, lo, hi) -> dict:
        m = lo if hi is None else round(math.sqrt(lo * hi))
        times = {str(s): round(self.predict_us(stats, s, m), 3) for s in candidates}
        return {"m_lo": lo, "m_hi": hi, "m": m, "predicted_us": times, "best": min(times, key=times.get)}


def time_site(weight: torch.Tensor, spec: FormatSpec, m: int, *, repeats: int = 7,
              budget_s: float = 0.5) -> float:
    """Fastest wall time (us) of the site's op for ``spec`` on random inputs with ``m`` rows,
    over up to ``repeats`` runs within ``budget_s``: the minimum is the least disturbed by
    other work on the machine."""
    packed = pack(weight, spec)
    x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
    op = OP_FOR_KIND[spec.kind]
    args = (x, *packed.tensors().values(), *packed.scalars().values(), None, "none", False, False)
    with torch.no_grad():
        op(*args)
        samples = []
        deadline = time.perf_counter() + budget_s
        while len(samples) < repeats and (len(samples) < 2 or time.perf_counter() < deadline):
            if weight.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            op(*args)
            if weight.device.type == "cuda":
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e6)
    return min(samples)
