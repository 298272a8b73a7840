"""``sparsecc calibrate``: time every implementation the cost model chooses between on a small
grid of shapes (:func:`calibration_workloads`), fit its numbers (:mod:`sparsecc.planner.fit`)
and cache them for this GPU (or CPU) and these torch, CUDA and sparsecc versions.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from ..errors import KernelBuildError
from ..ir.analysis import analyze
from ..ir.formats import FormatSpec
from ..ir.weights import random_weight
from ..ir.workload import Workload
from ..kernels.base import kernels_unavailable
from ..kernels.registry import plan_kernels
from ..runtime.cache_files import device_name, machine_key
from ..runtime.kernel_op import ensure
from ..runtime.timing import reference_us, time_us
from .cost import CostModel, site_runner
from .fit import Calibration, fit_measurements, save
from .work import DEFAULT_SMS

log = logging.getLogger("sparsecc")

#: on the CPU the probes are timed in this many rounds over all of them, each keeping its
#: fastest: a shared machine's speed drifts by tens of percent over seconds, and rounds spread
#: over the whole calibration catch each probe at least once undisturbed
CPU_ROUNDS = 5


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
    """Time each probe (:mod:`sparsecc.runtime.timing`) and return one row per probe: the
    implementation's :class:`Workload` fields plus ``format``, ``pattern`` and measured ``us``.
    On the CPU the probes are timed in :data:`CPU_ROUNDS` rounds and each keeps its fastest (with
    ``reference``: :func:`~sparsecc.runtime.timing.reference_us` is appended every 20 probes),
    as :func:`~sparsecc.runtime.timing.time_all_us` does."""
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
    return plan_kernels([SimpleNamespace(choice=p.format, dtype=p.dtype, shape=(p.n, p.k), density=p.density, m=p.m)
                         for p in probes])


def prebuild_kernels(probes: list[Probe], device: torch.device, *, progress: bool = True) -> None:
    """Load the probes' kernels before any is timed, compiling the missing ones in one parallel
    build: on a machine with an empty kernel cache, probe after probe would compile them one
    dispatch table at a time (a whole calibration of an H100 machine took 318 s that way, 145 s
    with the 46 kernels built at once by 16 nvcc jobs). Nothing to do where the kernels cannot
    run; a kernel that fails to build is reported by the probe that needs it."""
    if kernels_unavailable(device) is not None:
        return
    try:
        ensure(probe_kernels(probes), progress=progress)
    except KernelBuildError as error:
        log.warning("calibration: building the probes' kernels failed (%s); each probe builds its own",
                    str(error).splitlines()[0])


def calibrate(device: torch.device | str = "cuda", *, progress: bool = True, save_result: bool = True) -> Calibration:
    """Measure this machine (:func:`calibration_workloads`), fit, cache and return the result."""
    device = torch.device(device)
    key, name = machine_key(device), device_name(device)
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
