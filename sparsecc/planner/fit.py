"""How fast each implementation runs on this machine: the fitted numbers and their cache.

The cost model predicts a site's time per implementation (what actually runs a format on a
device: :mod:`sparsecc.planner.work`) from what the work needs -- flops executed (tile padding
included) and bytes moved -- and a few numbers per implementation that only a measurement can
give:

    us = overhead + ((flops / rate) ** p + (bytes / bandwidth) ** p + (steps * step_us) ** p) ** (1 / p)

``p`` blends a roofline's max (large p: compute and memory overlap, one kernel) with a sum
(p = 1: phases that run one after the other, e.g. unpack then multiply). On the CPU a weight
called again and again stays cached when it fits, and is read much faster than one that does
not (on a 2-core VM about 4x faster): there the bytes up to ``cache_bytes`` move at
``cache_bandwidth`` and the rest at ``bandwidth``. Where that boundary lies (one core's L2, or
a share of the last-level cache) depends on the machine and the implementation; the
calibration tries each (:func:`sparsecc.planner.calibrate.cache_boundaries`) and keeps, per implementation, the one that
fits its probes best. On the GPU every timing reads its weight from memory (copies cycled past
the L2), so ``cache_bytes`` is 0 there. Also on the CPU, torch's kernels spend on the
activations more than their bytes' worth: oneDNN reorders x for its 16-bit products (a
1024x256 weight multiplies 256 rows in 92 us, a 256x1024 one in 163), torch's CSR product
walks x and y per row of the batch (about 1.3 ns per element of either at 1% density,
whatever N, K or the stored count). The bytes of x and of y therefore cost extra time at
``x_bandwidth`` and ``y_bandwidth`` of their own (``Workload.activation_bytes``; fitted on the
CPU only, 0 meaning not modelled). ``steps`` counts the dependent pipeline steps of sparsecc's
BSR and CSR kernels on the busiest SM (:func:`sparsecc.planner.work.steps`):
at small batch these kernels wait on each step's loads, so their time follows the steps a
CTA runs one after another, not the bytes (a 64x16 block makes four times the steps of a
16x64 one in a quarter of the CTAs); ``step_us`` is fitted for them only.
:mod:`sparsecc.planner.calibrate` times every implementation on a small grid of shapes, fits
the numbers per implementation in log space with torch's LBFGS (:func:`fit_measurements`) and
caches the result per machine (GPU name or CPU, torch, CUDA and sparsecc versions).
:func:`for_device` returns the cached calibration, else the one shipped with sparsecc for that
kind of device (``sparsecc/planner/calibrations/*.json``), marked as borrowed.
"""
from __future__ import annotations

import importlib.resources
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from ..ir.workload import Workload
from ..runtime.cache_files import cache_file, machine_key, write_atomically
from .work import DEFAULT_SMS, known, steps, work

log = logging.getLogger("sparsecc")

CALIBRATION_VERSION = 1


@dataclass
class Fit:
    """The numbers of one implementation (see the module docstring)."""

    overhead_us: float
    rate: float            # flop/s
    bandwidth: float       # byte/s
    p: float
    points: int = 0        # measurements it was fitted on
    median_error: float = 0.0   # median |predicted / measured - 1| over those
    step_us: float = 0.0   # us per dependent pipeline step (:func:`steps`; 0: not modelled)
    #: measured / fitted time per calibrated M (the geometric mean over that M's probes): what
    #: the four numbers miss when a library changes algorithm with the batch (MKL's BSR product
    #: is twice as slow at 8 rows as at 16; sparsecc's kernels change tiles)
    m_profile: dict[str, float] = field(default_factory=dict)
    #: bytes read at ``cache_bandwidth`` before the rest moves at ``bandwidth`` (0: one regime)
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0
    #: the extra cost of x's and of y's bytes (``Workload.activation_bytes``; 0: not modelled)
    x_bandwidth: float = 0.0
    y_bandwidth: float = 0.0

    def memory_us(self, nbytes: float, x_bytes: float = 0.0, y_bytes: float = 0.0) -> float:
        """Microseconds to move ``nbytes``: the cached part first, then the rest; plus the
        extra time of the activations' bytes where it is modelled."""
        extra = sum(b / bw for b, bw in ((x_bytes, self.x_bandwidth), (y_bytes, self.y_bandwidth)) if bw > 0)
        if self.cache_bytes <= 0 or self.cache_bandwidth <= 0:
            return (nbytes / self.bandwidth + extra) * 1e6
        cached = min(nbytes, self.cache_bytes)
        return (cached / self.cache_bandwidth + (nbytes - cached) / self.bandwidth + extra) * 1e6

    def predict_us(self, flops: float, nbytes: float, n_steps: float = 0.0, x_bytes: float = 0.0,
                   y_bytes: float = 0.0) -> float:
        """The fitted time, before :meth:`m_factor`."""
        compute, memory = flops / self.rate * 1e6, self.memory_us(nbytes, x_bytes, y_bytes)
        latency = n_steps * self.step_us
        return self.overhead_us + (compute ** self.p + memory ** self.p + latency ** self.p) ** (1 / self.p)

    def m_factor(self, m: int) -> float:
        """:attr:`m_profile` at ``m`` rows: log-linear between the calibrated Ms, flat beyond them."""
        if not self.m_profile:
            return 1.0
        known = sorted((int(k), math.log(v)) for k, v in self.m_profile.items())
        if m <= known[0][0] or m >= known[-1][0]:
            return math.exp(known[0][1] if m <= known[0][0] else known[-1][1])
        (m0, f0), (m1, f1) = next((a, b) for a, b in zip(known, known[1:]) if a[0] <= m <= b[0])
        t = math.log(m / m0) / math.log(m1 / m0)
        return math.exp(f0 + t * (f1 - f0))


@dataclass
class Calibration:
    """Fitted numbers per implementation and dtype class (``impl/16bit`` or ``impl/float32``)
    for one machine, the measurements they came from, and whether they were measured here."""

    key: str
    device: str
    fits: dict[str, Fit]
    sms: int = DEFAULT_SMS
    measurements: list[dict] = field(default_factory=list)
    borrowed: bool = False
    version: int = CALIBRATION_VERSION
    #: CPU only: :func:`sparsecc.runtime.timing.reference_us` at calibration, the fastest of the
    #: timings made between its probes (the state of the machine the probes saw)
    reference_us: float | None = None

    def fit_for(self, impl: str, dtype: str) -> Fit | None:
        return self.fits.get(f"{impl}/{dtype_class(dtype)}")

    def predict_us(self, w: Workload) -> float | None:
        """Predicted microseconds of ``w``, or None if ``w``'s implementation was not calibrated."""
        fit = self.fit_for(w.impl, w.dtype)
        if fit is None:
            return None
        return fit.predict_us(*work(w, self.sms), steps(w, self.sms), *w.activation_bytes()) * fit.m_factor(w.m)

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("borrowed")
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, borrowed: bool = False) -> "Calibration":
        data = json.loads(text)
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"calibration version {data.get('version')!r}, expected {CALIBRATION_VERSION}")
        data["fits"] = {name: Fit(**fit) for name, fit in data["fits"].items()}
        return cls(**data, borrowed=borrowed)


def dtype_class(dtype: str) -> str:
    """fp16 and bf16 run the same tensor-core and memory paths; fp32 others."""
    return "16bit" if dtype in ("float16", "bfloat16") else "float32"


# ------------------------------------------------------------------------ the machine key

def cache_path(device: torch.device) -> Path:
    return cache_file("calibration", machine_key(device))


def save(calibration: Calibration, device: torch.device) -> Path:
    path = cache_path(device)
    write_atomically(path, calibration.to_json())
    return path


@lru_cache(maxsize=None)
def _packaged(kind: str) -> Calibration | None:
    resource = importlib.resources.files("sparsecc.planner") / "calibrations" / f"{kind}.json"
    if not resource.is_file():
        return None
    return Calibration.from_json(resource.read_text(), borrowed=True)


def for_device(device: torch.device | str) -> Calibration | None:
    """This machine's cached calibration, else the packaged one for the device type
    (``borrowed=True``), else None."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():      # planning for a GPU elsewhere
        return _packaged("cuda")
    path = cache_path(device)
    if path.is_file():
        try:
            return Calibration.from_json(path.read_text())
        except (ValueError, TypeError, KeyError) as error:
            log.warning("ignoring the unreadable calibration %s (%s); run `sparsecc calibrate`", path, error)
    return _packaged("cuda" if device.type == "cuda" else "cpu")


# ------------------------------------------------------------------------ fitting

def fit(points: list[tuple[float, ...]], *, cache_bytes: float = 0.0,
        activations: list[tuple[float, float]] | None = None) -> Fit:
    """Fit overhead, rate, bandwidth and p (and step_us where the points count steps) to
    ``(flops, bytes, measured us)`` or ``(flops, bytes, steps, measured us)`` points by least
    squares on the log of predicted / measured (a relative error, whatever the scale). With
    ``cache_bytes`` and at least two points on each side of it, ``cache_bandwidth`` is fitted
    too; with ``activations`` (each point's x and y bytes, ``Workload.activation_bytes``),
    ``x_bandwidth`` and ``y_bandwidth``. Should a fit with these extra terms not converge
    (few points, parameters more), the plain one-regime fit is returned."""
    found = _fit(points, cache_bytes, activations)
    numbers = (found.overhead_us, found.rate, found.bandwidth, found.p, found.median_error, found.cache_bandwidth,
               found.x_bandwidth, found.y_bandwidth)
    if (found.cache_bytes or activations) and not all(math.isfinite(x) for x in numbers):
        return _fit(points, 0.0, None)
    return found


def _fit(points, cache_bytes: float, activations) -> Fit:
    points = [p if len(p) == 4 else (p[0], p[1], 0.0, p[2]) for p in points]
    flops, nbytes, n_steps, measured = (torch.tensor(column, dtype=torch.float64) for column in zip(*points))
    x_bytes, y_bytes = (torch.tensor(column, dtype=torch.float64) for column in zip(*(activations or [(0.0, 0.0)])))
    stepped = bool((n_steps > 0).any())
    cached = (cache_bytes > 0 and int((nbytes <= cache_bytes).sum()) >= 2
              and int((nbytes > cache_bytes).sum()) >= 2)
    active = activations is not None and bool((x_bytes > 0).any())
    # start from a roofline through the fastest points (the activations' own terms start small)
    rate0 = float((flops / (measured * 1e-6)).max().clamp_min(1.0))
    bw0 = float((nbytes / (measured * 1e-6)).max().clamp_min(1.0))
    step0 = float((measured / n_steps.clamp_min(1.0)).median()) * 0.5 if stepped else 1.0
    c0 = float(measured.min()) * 0.5

    def predicted(theta):
        c, rate, bw = theta[0].exp(), theta[1].exp(), theta[2].exp()
        p = 1 + 7 * torch.sigmoid(theta[3])
        if cached:
            in_cache = nbytes.clamp(max=cache_bytes)
            memory = (in_cache / theta[5].exp() + (nbytes - in_cache) / bw) * 1e6
        else:
            memory = nbytes / bw * 1e6
        if active:
            memory = memory + (x_bytes / theta[6].exp() + y_bytes / theta[7].exp()) * 1e6
        terms = [flops / rate * 1e6, memory] + ([n_steps * theta[4].exp()] if stepped else [])
        scale = torch.stack(terms).amax(0)
        return c + scale * sum((t / scale) ** p for t in terms) ** (1 / p)

    def solve(p_start: float) -> tuple[float, torch.Tensor]:
        params = torch.tensor([math.log(max(c0, 0.1)), math.log(rate0), math.log(bw0), p_start,
                               math.log(max(step0, 1e-3)), math.log(bw0), math.log(bw0 * 10), math.log(bw0 * 10)],
                              dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([params], max_iter=500, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = ((predicted(params) / measured).log() ** 2).mean()
            loss.backward()
            return loss
        optimizer.step(closure)
        with torch.no_grad():
            loss = float(((predicted(params) / measured).log() ** 2).mean())
        return (loss if math.isfinite(loss) else math.inf), params.detach()

    # from a blend between max and sum (p = 4.5) and from a sum (p = 1.1): one start can stall
    # where the other does not (torch's CPU CSR product, 8 probes: 41% median error against 9%)
    _, params = min((solve(start) for start in (0.0, -4.0)), key=lambda found: found[0])
    with torch.no_grad():
        errors = (predicted(params) / measured - 1).abs()
        c, rate, bw, q, step, cache_bw, x_bw, y_bw = params.tolist()
    return Fit(overhead_us=math.exp(c), rate=math.exp(rate), bandwidth=math.exp(bw),
               p=1 + 7 * float(torch.sigmoid(torch.tensor(q))), points=len(points), median_error=float(errors.median()),
               step_us=math.exp(step) if stepped else 0.0, cache_bytes=cache_bytes if cached else 0.0,
               cache_bandwidth=math.exp(cache_bw) if cached else 0.0,
               x_bandwidth=math.exp(x_bw) if active else 0.0, y_bandwidth=math.exp(y_bw) if active else 0.0)


def fit_measurements(measurements: list[dict], sms: int, *, cache_bytes: float | list[float] = 0.0,
                     activations: bool = False) -> dict[str, Fit]:
    """One :class:`Fit` per implementation and dtype class found in ``measurements``, with its
    M profile where the probes span more than one M (and the cache regime and, with
    ``activations``, the activation terms of :func:`fit`). Given a list of cache boundaries
    (:func:`sparsecc.planner.calibrate.cache_boundaries`), each implementation keeps the one,
    or none, that explains its probes best: their weights straddle different caches (a BSR
    product reads its stored blocks, a dense one the whole weight). Likewise with or without
    the activation terms. Rows of implementations this sparsecc no longer has are left out."""
    groups: dict[str, list] = {}
    for row in measurements:
        if not known(row["impl"]):
            continue
        w = workload_from_row(row)
        groups.setdefault(f"{w.impl}/{dtype_class(w.dtype)}", []).append((w, (*work(w, sms), steps(w, sms), row["us"])))
    tried = [0.0, *cache_bytes] if isinstance(cache_bytes, (list, tuple)) else [cache_bytes]
    # the simpler fits are tried too: with few probes the optimizer can stall on more parameters
    variants = list(dict.fromkeys((boundary, extra) for boundary in tried for extra in {activations, False}))
    fits = {}
    for name, rows in sorted(groups.items()):
        found = [_fit_group(rows, boundary, extra) for boundary, extra in variants]
        fits[name] = min(found, key=lambda pair: pair[0])[1]
    return fits


def _fit_group(rows: list, cache_bytes: float, activations: bool) -> tuple[float, Fit]:
    """One implementation's :class:`Fit` and M profile, with its mean squared log error."""
    extra = [w.activation_bytes() for w, _ in rows]
    found = fit([point for _, point in rows], cache_bytes=cache_bytes, activations=extra if activations else None)
    fitted = [(w.m, found.predict_us(flops, nbytes, n_steps, *x_y), us)
              for (w, (flops, nbytes, n_steps, us)), x_y in zip(rows, extra)]
    residuals: dict[int, list[float]] = {}
    for m, predicted, us in fitted:
        residuals.setdefault(m, []).append(math.log(us / predicted))
    if len(residuals) > 1:
        found.m_profile = {str(m): round(math.exp(sum(r) / len(r)), 4) for m, r in sorted(residuals.items())}
        errors = sorted(abs(predicted * found.m_factor(m) / us - 1) for m, predicted, us in fitted)
        found.median_error = errors[len(errors) // 2]
    loss = sum(math.log(predicted * found.m_factor(m) / us) ** 2 for m, predicted, us in fitted) / len(fitted)
    return (loss if math.isfinite(loss) else math.inf), found


def workload_from_row(row: dict) -> Workload:
    fields = {name: row.get(name) for name in Workload.__dataclass_fields__ if row.get(name) is not None}
    for name in ("block", "tile"):
        if name in fields:
            fields[name] = tuple(fields[name])
    return Workload(**fields)
