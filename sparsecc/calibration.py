"""How fast each implementation runs on this machine: microbenchmarks, a fitted model, a cache.

The cost model predicts a site's time per implementation (the kernel that actually runs a
format on a device, see :data:`IMPLS`) from what the work needs -- flops executed (tile
padding included) and bytes moved -- and a few numbers per implementation that only a
measurement can give:

    us = overhead + ((flops / rate) ** p + (bytes / bandwidth) ** p + (steps * step_us) ** p) ** (1 / p)

``p`` blends a roofline's max (large p: compute and memory overlap, one kernel) with a sum
(p = 1: phases that run one after the other, e.g. unpack then multiply). On the CPU a weight
called again and again stays cached when it fits, and is read much faster than one that does
not (on a 2-core VM about 4x faster): there the bytes up to ``cache_bytes`` move at
``cache_bandwidth`` and the rest at ``bandwidth``. Where that boundary lies (one core's L2, or
a share of the last-level cache) depends on the machine and the implementation; the
calibration tries each (:func:`cache_boundaries`) and keeps, per implementation, the one that
fits its probes best. On the GPU every timing reads its weight from memory (copies cycled past
the L2), so ``cache_bytes`` is 0 there. Also on the CPU, torch's kernels spend on the
activations more than their bytes' worth: oneDNN reorders x for its 16-bit products (a
1024x256 weight multiplies 256 rows in 92 us, a 256x1024 one in 163), torch's CSR product
walks x and y per row of the batch (about 1.3 ns per element of either at 1% density,
whatever N, K or the stored count). The bytes of x and of y therefore cost extra time at
``x_bandwidth`` and ``y_bandwidth`` of their own (:func:`activation_bytes`; fitted on the
CPU only, 0 meaning not modelled). ``steps`` counts the
dependent pipeline steps of sparsecc's BSR and CSR kernels on the busiest SM (:func:`steps`):
at small batch these kernels wait on each step's loads, so their time follows the steps a
CTA runs one after another, not the bytes (a 64x16 block makes four times the steps of a
16x64 one in a quarter of the CTAs); ``step_us`` is fitted for them only. :func:`calibrate`
times every implementation on a small grid of shapes (:func:`calibration_workloads`), fits
the numbers per implementation in log space with torch's LBFGS, and caches the result
per machine (GPU name or CPU, torch, CUDA and sparsecc versions). :func:`for_device` returns
the cached calibration, else the one shipped with sparsecc for that kind of device
(``sparsecc/calibrations/*.json``), marked as borrowed.
"""
from __future__ import annotations

import importlib.resources
import json
import logging
import math
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch

from .errors import KernelBuildError

log = logging.getLogger("sparsecc")

#: what runs a format: torch's dense GEMM, sparsecc's 2:4 CUTLASS GEMM and small-batch kernel,
#: torch's n:m path (unpack to dense, then dense), torch's BSR product (or, where torch has
#: no BSR kernel for the dtype or block, sparsecc.ops' batched block products), sparsecc's
#: BSR kernels (wgmma; streaming on CUDA cores; mma.sync for small batches), torch's CSR product
#: and sparsecc's CSR kernel
IMPLS = ("dense", "sparse24-gemm", "sparse24-gemv", "sparse24-mma", "nm-unpack", "bsr", "bsr-bmm", "bsr-kernel", "bsr-kernel-small",
         "bsr-kernel-mma", "csr", "csr-kernel")
#: on the CPU the probes are timed in this many rounds over all of them, each keeping its
#: fastest: a shared machine's speed drifts by tens of percent over seconds, and rounds spread
#: over the whole calibration catch each probe at least once undisturbed
CPU_ROUNDS = 5
#: streaming multiprocessors assumed when no GPU is present to ask (an H100 SXM)
DEFAULT_SMS = 132
CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class Workload:
    """One product ``[m, k] x [k, n]`` on one implementation, with what its cost depends on."""

    impl: str
    dtype: str
    m: int
    n: int
    k: int
    density: float = 1.0                       # non-zeros / elements of the weight
    block: tuple[int, int] | None = None       # BSR block (rows, cols)
    block_density: float | None = None         # stored blocks / all blocks
    tile: tuple[int, int] | None = None        # (rows of W, rows of x) per CTA of a sparsecc kernel

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown implementation {self.impl!r} (known: {IMPLS})")


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def work(w: Workload, sms: int = DEFAULT_SMS) -> tuple[float, float]:
    """``(flops, bytes)`` the implementation spends on ``w``: flops as executed (zero blocks
    skipped, tiles padded), bytes of the weight in its format plus the activations, and the
    copies torch's sparse paths make (fp32 conversions, the unpacked dense weight)."""
    e = element_size(w.dtype)
    m, n, k = w.m, w.n, w.k
    act = (m * k + m * n) * e
    if w.impl == "dense":
        return 2.0 * m * n * k, n * k * e + act
    if w.impl == "sparse24-gemm":
        tile_n, tile_m = w.tile or (128, 64)
        tiles = math.ceil(n / tile_n) * math.ceil(m / tile_m)
        waves = math.ceil(tiles / sms) * sms / tiles
        return tiles * tile_n * tile_m * k * waves, n * k * e * 9 / 16 + act     # half the math of dense
    if w.impl in ("sparse24-gemv", "sparse24-mma"):
        return 1.0 * m * n * k, n * k * e * 9 / 16 + act
    if w.impl == "nm-unpack":     # values + uint8 indices read, dense weight written and read back
        kept = n * k * w.density
        return 2.0 * m * n * k, kept * (e + 1) + 2 * n * k * e + act
    if w.impl in ("bsr-kernel-small", "bsr-kernel-mma"):
        # the small-batch kernels: the stored blocks and their block columns read once (x's
        # matching inputs come from L1/L2), y written once; fp32 sums (CUDA cores for one row
        # of x, mma.sync for up to 16)
        h, bw = w.block or (32, 32)
        stored = (w.block_density if w.block_density is not None else w.density) * n * k
        return 2.0 * m * stored, stored * e + stored / (h * bw) * 4 + m * k * e + m * n * e
    if w.impl == "bsr-kernel":
        # stored blocks only, x's rows padded to the tile. Loads bound the kernel (TMA): every
        # block row gathers its columns of x again, and every tile of x's rows reads the stored
        # blocks again. A block column no block row stores (each with probability
        # (1 - density) ** block rows, blocks placed at random) gets a block of zeros
        h, bw = w.block or (32, 32)
        tile_m = (w.tile or (h, 128))[1]
        density = w.block_density if w.block_density is not None else w.density
        stored = density * n * k + (1.0 - density) ** math.ceil(n / h) * k * h
        tiles = math.ceil(m / tile_m)
        gathered = m * stored / h * e + tiles * stored * e
        # an MMA narrower than 64 outputs (the block's rows) issues as slowly as a 64-wide one
        narrow = max(1.0, 64 / h)
        # one CTA per block row and tile of x: with fewer CTAs than SMs, the idle SMs' share of
        # the bandwidth is lost (counted as more bytes)
        idle = max(1.0, sms / (math.ceil(n / h) * tiles))
        return 2.0 * tiles * tile_m * stored * narrow, (gathered + m * n * e) * idle
    if w.impl == "csr-kernel":
        # every tile multiplied densely (x's rows padded to the tile, K to 64), 4 bytes per
        # stored entry read, x and y once
        tile_m = (w.tile or (64, 16))[1]
        rows = math.ceil(m / tile_m) * tile_m
        return 2.0 * rows * n * math.ceil(k / 64) * 64, w.density * n * k * (e + 2) + act
    wide = 4 if e < 4 else e       # torch's sparse products run 16-bit inputs in fp32
    if w.impl in ("bsr", "bsr-bmm"):
        h, bw = w.block or (32, 32)
        stored = (w.block_density if w.block_density is not None else w.density) * n * k
        blocks = stored / (h * bw)
        converted = (stored + m * k) * (e + wide) if wide != e else 0
        gathered = blocks * (h + bw) * m * wide * 2 if w.impl == "bsr-bmm" else 0   # x gathered, products scattered
        return 2.0 * m * stored, stored * e + blocks * 4 + act + converted + m * n * wide + gathered
    nnz = w.density * n * k                                               # csr
    converted = (nnz + m * k) * (e + wide) if wide != e else 0
    return 2.0 * m * nnz, nnz * (e + 4) + n * 4 + act + converted + m * n * wide


def activation_bytes(w: Workload) -> tuple[float, float]:
    """``(x bytes, y bytes)`` of ``w``: what the activation terms of a fit (``x_bandwidth``,
    ``y_bandwidth``) charge for, beyond their share of :func:`work`'s bytes."""
    e = element_size(w.dtype)
    return float(w.m * w.k * e), float(w.m * w.n * e)


#: CTAs resident per SM of the wgmma BSR kernel, as built: about four (its kCtasPerSm: three or
#: two for the largest tiles); the CSR kernels' count is csr_kernel.resident_ctas
BSR_RESIDENT_CTAS = 4
#: warps resident per SM of the streaming BSR kernel (64 registers a thread), and the warps each
#: lets share a block row at most (templates/bsr_sm90.cu.j2: kMaxSplit)
STREAM_WARPS_PER_SM, STREAM_MAX_SPLIT = 32, 4
#: the small-batch mma BSR kernel (templates/bsr_mma_sm90.cu.j2): its warps resident per SM with
#: one block per lane in flight (64 registers a thread: four CTAs of 8 warps) and with two (about
#: 120: two CTAs), and its kMaxSplit
MMA_WARPS_PER_SM, MMA_WARPS_PER_SM_TWO_BLOCKS, MMA_MAX_SPLIT = 32, 16, 8


def _split(slices: float, max_split: int, slots: float) -> int:
    """The small-batch BSR kernels' split of a block row: doubled while the warps fit one wave."""
    split = 1
    while split < max_split and slices * split * 2 <= slots:
        split *= 2
    return split


def _stream_steps(w: Workload, sms: int) -> float:
    """The small-batch BSR kernels' rounds of loads one after another on the busiest warp slot:
    a warp's rounds (its share of a block row's blocks, its loads in flight per round) times
    the waves of warps, with the kernel's split of block rows across warps. The streaming kernel
    (1-4 rows of x per CTA) gives a warp 256 / w weight rows and 4 or 2 blocks per round; the
    mma kernel (16 rows of x) 16 weight rows and 64 / w blocks, or 128 / w where that saves two
    rounds or more (as its launch picks, from the longest block row: here the average one)."""
    h, bw = w.block or (32, 32)
    tile_m = (w.tile or (h, 1))[1]
    density = w.block_density if w.block_density is not None else w.density
    blocks = density * w.k / bw                                   # stored blocks of a block row
    if w.impl == "bsr-kernel-mma":
        options = [(MMA_WARPS_PER_SM, max(1.0, 64 / bw)), (MMA_WARPS_PER_SM_TWO_BLOCKS, max(1.0, 128 / bw))]
        (slots, loads, split), (slots_two, loads_two, split_two) = [
            (warps, loads, _split(w.n / 16, MMA_MAX_SPLIT, sms * warps)) for warps, loads in options]
        if math.ceil(blocks / (split_two * loads_two)) + 2 <= math.ceil(blocks / (split * loads)):
            slots, loads, split = slots_two, loads_two, split_two
        slices = w.n / 16
    else:                              # splits while they fit the SM's 64 warp slots
        slices, slots = w.n * bw / 256, STREAM_WARPS_PER_SM
        loads = 4 if tile_m == 1 else 2
        split = _split(slices, STREAM_MAX_SPLIT, sms * 64)
    rounds = max(1.0, math.ceil(blocks / (split * loads)))
    warps = slices * split * math.ceil(w.m / tile_m)
    return rounds * max(1.0, warps / (sms * slots))


def steps(w: Workload, sms: int = DEFAULT_SMS) -> float:
    """Dependent pipeline steps on the busiest SM (see the module docstring): the steps of one
    CTA times the CTAs each resident slot runs; 0 for implementations not modelled by steps."""
    if w.impl in ("bsr-kernel-small", "bsr-kernel-mma"):
        return _stream_steps(w, sms)
    if w.impl not in ("bsr-kernel", "csr-kernel"):
        return 0.0
    from .codegen import CSR_TILE_N
    if w.impl == "csr-kernel":
        from .csr_kernel import TILE_K, expected_capacity, k_slices, kernel_spec, resident_ctas
        tile_m = (w.tile or (CSR_TILE_N, 16))[1]
        spec = kernel_spec("float16", tile_m, expected_capacity(w.density))
        ctas = math.ceil(w.n / CSR_TILE_N) * math.ceil(w.m / tile_m)
        k_tiles = math.ceil(w.k / TILE_K)
        splits = k_slices(math.ceil(w.n / CSR_TILE_N) * CSR_TILE_N, w.m, w.k, spec, sms)
        per_cta = math.ceil(k_tiles / splits / spec.csr_step_tiles)
        return per_cta * max(1.0, ctas * splits / (sms * resident_ctas(spec)))
    h, bw = w.block or (32, 32)
    tile_m = (w.tile or (h, 64))[1]
    density = w.block_density if w.block_density is not None else w.density
    step_k = min(bw, 64)       # the wgmma kernel loads one block (or 64 columns) per step
    per_cta = density * w.k / step_k
    ctas = math.ceil(w.n / h) * math.ceil(w.m / tile_m)
    return per_cta * max(1.0, ctas / (sms * BSR_RESIDENT_CTAS))


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
    #: the extra cost of x's and of y's bytes (:func:`activation_bytes`; 0: not modelled)
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
    #: CPU only: :func:`sparsecc.timing.reference_us` at calibration, the fastest of the
    #: timings made between its probes (the state of the machine the probes saw)
    reference_us: float | None = None

    def fit_for(self, impl: str, dtype: str) -> Fit | None:
        return self.fits.get(f"{impl}/{dtype_class(dtype)}")

    def predict_us(self, w: Workload) -> float | None:
        """Predicted microseconds of ``w``, or None if ``w``'s implementation was not calibrated."""
        fit = self.fit_for(w.impl, w.dtype)
        if fit is None:
            return None
        return fit.predict_us(*work(w, self.sms), steps(w, self.sms), *activation_bytes(w)) * fit.m_factor(w.m)

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

def machine_key(device: torch.device) -> tuple[str, str]:
    """``(key, device name)``: what a calibration is valid for."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{platform.machine()}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"
    from . import __version__
    key = f"{name}|torch {torch.__version__}|cuda {torch.version.cuda}|sparsecc {__version__}"
    return key, name


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def cache_path(device: torch.device) -> Path:
    from .config import settings
    key, _ = machine_key(device)
    return settings().cache_dir / "calibration" / f"{_slug(key)}.json"


def save(calibration: Calibration, device: torch.device) -> Path:
    path = cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(calibration.to_json())
    staging.replace(path)
    return path


@lru_cache(maxsize=None)
def _packaged(kind: str) -> Calibration | None:
    resource = importlib.resources.files("sparsecc") / "calibrations" / f"{kind}.json"
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
    too; with ``activations`` (each point's x and y bytes, :func:`activation_bytes`),
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
    (:func:`cache_boundaries`), each implementation keeps the one, or none, that explains its
    probes best: their weights straddle different caches (a BSR product reads its stored
    blocks, a dense one the whole weight). Likewise with or without the activation terms."""
    groups: dict[str, list] = {}
    for row in measurements:
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
    extra = [activation_bytes(w) for w, _ in rows]
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


# ------------------------------------------------------------------------ measuring

def random_weight(n: int, k: int, pattern: str, density: float, dtype: torch.dtype, device,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A random ``[n, k]`` weight with a sparsity ``pattern``: ``dense``, ``n:m`` (e.g.
    ``2:4``: the largest n of every m kept), ``block<h>`` or ``block<h>x<w>`` (that fraction of
    blocks kept) or ``unstructured`` (that fraction of elements kept). Values are normal,
    never zero where kept."""
    def uniform(*shape):
        return torch.rand(*shape, generator=generator, device=generator.device if generator else device)

    values = torch.randn(n, k, generator=generator, device=generator.device if generator else device) * 0.05
    values = values + values.sign() * 1e-3              # no accidental zeros
    if pattern == "dense":
        mask = torch.ones_like(values, dtype=torch.bool)
    elif match := re.fullmatch(r"(\d+):(\d+)", pattern):
        keep, group = int(match[1]), int(match[2])
        grouped = values.abs().reshape(n, k // group, group)
        order = grouped.argsort(dim=-1, descending=True)
        mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, order[..., :keep], True).reshape(n, k)
    elif match := re.fullmatch(r"block(\d+)(?:x(\d+))?", pattern):
        h = int(match[1])
        w = int(match[2] or h)
        blocks = uniform(n // h, k // w) < density
        mask = blocks.repeat_interleave(h, 0).repeat_interleave(w, 1)
    elif pattern == "unstructured":
        mask = uniform(n, k) < density
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    return (values * mask).to(dtype=dtype, device=device)


@dataclass(frozen=True)
class Probe:
    """One calibration measurement: a weight (shape, pattern, density), a format, a batch."""

    n: int
    k: int
    pattern: str
    density: float
    format: str
    m: int
    dtype: str = "float16"


def calibration_workloads(device: torch.device) -> list[Probe]:
    """The microbenchmarks of one calibration: every implementation the device runs, on
    shapes and batch sizes that span small and large, memory- and compute-bound."""
    probes = []
    if device.type == "cuda":
        shapes = [(2048, 2048), (8192, 2048), (2048, 8192), (5120, 5120), (1024, 2048)]
        for n, k in shapes:
            probes += [Probe(n, k, "dense", 1.0, "dense", m) for m in (1, 8, 64, 512, 4096)]
            # 2:4 at every small-batch bucket of the tensor-core kernel (up to 64 rows) and beyond
            probes += [Probe(n, k, "2:4", 0.5, "2:4", m) for m in (1, 4, 8, 16, 32, 64, 128, 1024, 4096)]
        for n, k in ((512, 2048), (3072, 1024), (1536, 1536), (4096, 512), (8192, 8192)):   # batch 1
            probes += [Probe(n, k, "dense", 1.0, "dense", 1), Probe(n, k, "2:4", 0.5, "2:4", 1)]
        for n, k in shapes[1:3]:
            probes += [Probe(n, k, "1:4", 0.25, "1:4", m) for m in (1, 256, 4096)]
        # sparsecc's BSR kernels: square and non-square blocks (a block's rows set the CTAs, its
        # columns the steps), one kernel per M bucket
        for n, k in ((4096, 4096), (8192, 2048)):
            for block in ("16x16", "32x32", "64x64", "16x64", "64x16", "32x64"):
                probes += [Probe(n, k, f"block{block}", density, f"bsr{block}", m)
                           for density in (0.5, 0.1) for m in (1, 16, 128, 2048)]
        probes += [Probe(4096, 4096, "block64", density, "bsr64", 8192) for density in (0.5, 0.1)]
        for density in (0.3, 0.05, 0.01):    # sparsecc's CSR kernel
            probes += [Probe(4096, 4096, "unstructured", density, "csr", m) for m in (1, 16, 64, 512, 2048)]
        probes += [Probe(11008, 4096, "unstructured", density, "csr", m) for density in (0.3, 0.1) for m in (1, 64)]
        probes += [Probe(n, k, "unstructured", density, "csr", m) for n, k in ((8192, 2048), (2048, 8192))
                   for density in (0.1, 0.02) for m in (1, 16, 128)]
        for n, k in shapes[:2]:      # float32: torch's paths only
            probes += [Probe(n, k, "dense", 1.0, "dense", m, "float32") for m in (1, 512, 4096)]
        probes += [Probe(4096, 4096, "unstructured", d, "csr", m, "float32") for d in (0.1, 0.01) for m in (1, 512)]
        probes += [Probe(4096, 4096, "block32", d, "bsr32", m, "float32") for d in (0.5, 0.1) for m in (1, 512)]
        probes += [Probe(4096, 4096, "1:4", 0.25, "1:4", m, "float32") for m in (1, 512)]
        return probes
    # torch's CPU kernels change algorithm with the batch (MKL's gemv and gemm, its BSR product),
    # so every implementation is probed over the range of M the M profiles interpolate
    shapes = [(256, 1024), (1024, 256), (768, 768), (2048, 2048)]
    for n, k in shapes:
        probes += [Probe(n, k, "dense", 1.0, "dense", m, "float32") for m in (1, 4, 8, 16, 64, 128, 256, 512)]
        probes += [Probe(n, k, "dense", 1.0, "dense", m, "bfloat16") for m in (1, 8, 64, 256)]
    for n, k in shapes[:2] + [(128, 512), (2048, 2048)]:      # small and large: the overhead and the unpacking apart
        probes += [Probe(n, k, "2:4", 0.5, "2:4", m, dtype) for m in (1, 8, 64, 256) for dtype in ("float32", "bfloat16")]
    probes += [Probe(128, 512, "dense", 1.0, "dense", m, dtype) for m in (1, 8, 64, 256) for dtype in ("float32", "bfloat16")]
    # weights of 5-36 MB: where a large last-level cache stops holding a weight (cache_boundaries)
    probes += [Probe(1536, 1536, "dense", 1.0, "dense", m, dtype) for m in (1, 8, 64) for dtype in ("float32", "bfloat16")]
    probes += [Probe(3072, 3072, "dense", 1.0, "dense", m, "float32") for m in (1, 8)]
    for block in (16, 32, 64):
        for density in (0.5, 0.1):
            probes += [Probe(1024, 1024, f"block{block}", density, f"bsr{block}", m, "float32")
                       for m in (1, 8, 16, 64, 128, 256)]
    for density in (0.5, 0.1):
        probes += [Probe(1024, 1024, "block32x64", density, "bsr32x64", m, dtype)
                   for m in (1, 8, 64, 256) for dtype in ("float32", "bfloat16")]
        probes += [Probe(1024, 1024, "block32", density, "bsr32", m, "bfloat16") for m in (1, 8, 64, 256)]
    for n, k in ((1024, 1024), (2048, 2048)):
        probes += [Probe(n, k, "unstructured", d, "csr", m, "float32")
                   for d in (0.3, 0.05, 0.01) for m in (1, 8, 16, 64, 128, 256, 512)]
    for n, k in ((2048, 512), (512, 2048)):          # torch's sparse kernels: time depends on N and K apart
        probes += [Probe(n, k, "unstructured", d, "csr", m, "float32") for d in (0.3, 0.05, 0.01) for m in (1, 8, 64, 256)]
        probes += [Probe(n, k, f"block{b}", 0.1, f"bsr{b}", m, "float32") for b in (16, 32) for m in (1, 8, 64, 256)]
        probes += [Probe(n, k, "block32x64", 0.1, "bsr32x64", m, "float32") for m in (1, 8, 64, 256)]
    probes += [Probe(1024, 1024, "unstructured", d, "csr", m, "bfloat16") for d in (0.3, 0.02) for m in (1, 8, 64, 256)]
    return probes


def measure(probes: list[Probe], device: torch.device, *, progress: bool = True,
            description: str = "calibrating", reference: list[float] | None = None) -> list[dict]:
    """Time each probe (sparsecc.timing) and return one row per probe: the implementation's
    :class:`Workload` fields plus ``format``, ``pattern`` and measured ``us``. On the CPU the
    probes are timed in :data:`CPU_ROUNDS` rounds and each keeps its fastest (with
    ``reference``: :func:`~sparsecc.timing.reference_us` is appended every 20 probes),
    as :func:`~sparsecc.timing.time_all_us` does."""
    from tqdm import tqdm

    from .analysis import analyze
    from .cost import CostModel
    from .formats import FormatSpec
    from .timing import reference_us, site_runner, time_us
    model = CostModel(device, calibration=None)
    generator = torch.Generator(device).manual_seed(0)
    rounds = CPU_ROUNDS if device.type == "cpu" else 1
    weights: dict[tuple, tuple] = {}
    fastest: dict[int, float] = {}
    workloads: dict[int, Workload] = {}
    with tqdm(total=len(probes) * rounds, desc=description, disable=not progress, unit="probe") as bar:
        for _ in range(rounds):
            for index, probe in enumerate(probes):
                bar.update()
                if reference is not None and index % 20 == 0:
                    reference.append(reference_us())
                key = (probe.n, probe.k, probe.pattern, probe.density, probe.dtype)
                if key not in weights:
                    weight = random_weight(probe.n, probe.k, probe.pattern, probe.density,
                                           getattr(torch, probe.dtype), device, generator)
                    weights = {key: (weight, analyze(weight))}          # one weight alive at a time
                weight, stats = weights[key]
                spec = FormatSpec.parse(probe.format)
                workloads[index] = model.workload(stats, spec, probe.m, planned_m=probe.m)
                runner = site_runner(weight, spec, probe.m, on_kernel=model.uses_kernel(stats, spec),
                                     planned_m=probe.m)
                try:
                    us = time_us(runner, device)
                except RuntimeError as error:
                    log.warning("calibration: %s at M=%d failed and is left out: %s", probe, probe.m, error)
                    continue
                fastest[index] = min(us, fastest.get(index, float("inf")))
    return [{**asdict(workloads[i]), "format": probes[i].format, "pattern": probes[i].pattern,
             "us": round(fastest[i], 3)} for i in sorted(fastest)]


def cpu_caches() -> dict[int, float]:
    """The largest data (or unified) cache of each level, in bytes, from Linux's
    /sys/devices/system/cpu; empty where that is not readable."""
    sizes: dict[int, float] = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            found = int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        except (OSError, ValueError):
            continue
        sizes[level] = float(max(found, sizes.get(level, 0)))
    return sizes


def cache_boundaries(caches: dict[int, float]) -> list[float]:
    """Sizes up to which a weight called again and again may stay cached: one core's L2, and a
    quarter, half and all of the last level (shared with other cores and other data, a
    product's threads do not split a weight evenly). Which one holds is measured, per
    implementation (:func:`fit_measurements`): a 2-core VM with 1 MiB L2s and a 32 MiB L3
    reads 4 MiB weights at 2.5x the speed of 16 MiB ones."""
    found = [caches[2]] if caches.get(2) else []
    last = caches.get(max(caches)) if caches and max(caches) > 2 else None
    found += [last * f for f in (0.25, 0.5, 1.0)] if last else []
    return sorted(set(found))


def probe_kernels(probes: list[Probe]) -> list:
    """sparsecc's kernels the probes run on, listed as ``sparsecc generate`` lists a plan's
    (every CSR tile capacity a probe's density may need)."""
    from .gpu import plan_kernels
    return plan_kernels([SimpleNamespace(choice=p.format, dtype=p.dtype, shape=(p.n, p.k), density=p.density, m=p.m)
                         for p in probes])


def prebuild_kernels(probes: list[Probe], device: torch.device, *, progress: bool = True) -> None:
    """Load the probes' kernels before any is timed, compiling the missing ones in one parallel
    build: on a machine with an empty kernel cache, probe after probe would compile them one
    dispatch table at a time (a whole calibration of an H100 machine took 318 s that way, 145 s
    with the 46 kernels built at once by 16 nvcc jobs). Nothing to do where the kernels cannot
    run; a kernel that fails to build is reported by the probe that needs it."""
    from . import runtime
    from .gpu import kernels_unavailable
    if kernels_unavailable(device) is not None:
        return
    try:
        runtime.ensure(probe_kernels(probes), progress=progress)
    except KernelBuildError as error:
        log.warning("calibration: building the probes' kernels failed (%s); each probe builds its own",
                    str(error).splitlines()[0])


def calibrate(device: torch.device | str = "cuda", *, progress: bool = True, save_result: bool = True) -> Calibration:
    """Measure this machine (:func:`calibration_workloads`), fit, cache and return the result."""
    device = torch.device(device)
    key, name = machine_key(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    reference = [] if device.type == "cpu" else None
    probes = calibration_workloads(device)
    prebuild_kernels(probes, device, progress=progress)
    rows = measure(probes, device, progress=progress, reference=reference)
    if device.type == "cpu":
        fits = fit_measurements(rows, sms, cache_bytes=cache_boundaries(cpu_caches()), activations=True)
    else:
        fits = fit_measurements(rows, sms)
    calibration = Calibration(key=key, device=name, fits=fits, sms=sms,
                              measurements=rows,
                              reference_us=round(min(reference), 3) if reference else None)
    if save_result:
        path = save(calibration, device)
        log.info("calibration of %s saved to %s", name, path)
    return calibration
