"""Calibration: the work each implementation does, the fit, the per-machine cache, the
packaged fallbacks, and a small calibration of this CPU."""
import math

import pytest
import torch

from sparsecc.ir.analysis import analyze
from sparsecc.ir.weights import random_weight
from sparsecc.ir.workload import Workload
from sparsecc.planner import calibrate as calibration
from sparsecc.planner.fit import (Calibration, Fit, cache_path, fit, fit_measurements, for_device, save,
                                  workload_from_row)
from sparsecc.planner.work import DEFAULT_SMS, steps, work


def test_fit_recovers_the_numbers_it_was_made_from():
    truth = Fit(overhead_us=7.0, rate=2e12, bandwidth=3e11, p=3.0)
    gen = torch.Generator().manual_seed(3)
    points = []
    for _ in range(40):
        flops = float(10 ** (6 + 5 * torch.rand(1, generator=gen)))
        nbytes = float(10 ** (4 + 5 * torch.rand(1, generator=gen)))
        noise = 1 + 0.02 * float(torch.randn(1, generator=gen))
        points.append((flops, nbytes, truth.predict_us(flops, nbytes) * noise))
    fitted = fit(points)
    assert fitted.points == 40 and fitted.median_error < 0.03
    for flops, nbytes, _ in points:
        assert fitted.predict_us(flops, nbytes) == pytest.approx(truth.predict_us(flops, nbytes), rel=0.06)


def test_fit_recovers_a_step_latency():
    """Kernels modelled by their dependent steps: the fit finds the time per step."""
    truth = Fit(overhead_us=6.0, rate=4e14, bandwidth=2e12, p=1.5, step_us=0.4)
    gen = torch.Generator().manual_seed(4)
    points = []
    for _ in range(60):
        flops, nbytes, steps = (float(10 ** (lo + span * torch.rand(1, generator=gen)))
                                for lo, span in ((8, 4), (5, 3), (0, 3)))
        noise = 1 + 0.02 * float(torch.randn(1, generator=gen))
        points.append((flops, nbytes, steps, truth.predict_us(flops, nbytes, steps) * noise))
    fitted = fit(points)
    assert fitted.median_error < 0.03 and fitted.step_us == pytest.approx(0.4, rel=0.15)
    assert fit([(f, b, u) for f, b, _, u in points]).step_us == 0.0     # no steps given: none fitted


def test_fit_recovers_a_cache_regime():
    """Weights up to cache_bytes read fast, the rest slower (a CPU's L2): with points on both
    sides the fit finds both bandwidths; with all points inside the cache it keeps one."""
    truth = Fit(overhead_us=10.0, rate=4e11, bandwidth=3e10, p=1.0, cache_bytes=4 << 20, cache_bandwidth=1.2e11)
    gen = torch.Generator().manual_seed(5)
    points = []
    for _ in range(50):
        flops = float(10 ** (5 + 3 * torch.rand(1, generator=gen)))
        nbytes = float(10 ** (5 + 2.5 * torch.rand(1, generator=gen)))      # 100 KB .. 30 MB
        noise = 1 + 0.02 * float(torch.randn(1, generator=gen))
        points.append((flops, nbytes, truth.predict_us(flops, nbytes) * noise))
    fitted = fit(points, cache_bytes=4 << 20)
    assert fitted.cache_bandwidth == pytest.approx(1.2e11, rel=0.15) and fitted.bandwidth == pytest.approx(3e10, rel=0.15)
    for flops, nbytes, _ in points:
        assert fitted.predict_us(flops, nbytes) == pytest.approx(truth.predict_us(flops, nbytes), rel=0.08)
    inside = fit([p for p in points if p[1] <= 4 << 20], cache_bytes=4 << 20)
    assert inside.cache_bytes == 0 and inside.cache_bandwidth == 0        # nothing to tell the regimes apart
    one_beyond = [p for p in points if p[1] <= 4 << 20] + [max(points, key=lambda p: p[1])]
    assert fit(one_beyond, cache_bytes=4 << 20).cache_bytes == 0    # one point cannot fit a bandwidth
    assert Fit(1.0, 1.0, 2e10, 1.0).memory_us(8e6) == pytest.approx(400.0)


def test_fit_recovers_the_activations_extra_cost():
    """x and y cost time of their own (torch's CPU CSR product walks them per row of the batch,
    oneDNN reorders x): given each point's x and y bytes, the fit finds both rates; without
    them it keeps one memory term."""
    truth = Fit(overhead_us=20.0, rate=7e10, bandwidth=2e10, p=1.0, x_bandwidth=3e9, y_bandwidth=6e9)
    gen = torch.Generator().manual_seed(6)
    points, activations = [], []
    for _ in range(60):
        m, n, k = (int(2 ** (lo + span * float(torch.rand(1, generator=gen)))) for lo, span in ((0, 9), (8, 3), (8, 3)))
        density = float(10 ** (-2 + 1.5 * torch.rand(1, generator=gen)))
        w = Workload("csr", "float32", m, n, k, density=density)
        flops, nbytes = work(w)
        x_bytes, y_bytes = w.activation_bytes()
        assert (x_bytes, y_bytes) == (4.0 * m * k, 4.0 * m * n)
        noise = 1 + 0.02 * float(torch.randn(1, generator=gen))
        points.append((flops, nbytes, truth.predict_us(flops, nbytes, 0.0, x_bytes, y_bytes) * noise))
        activations.append((x_bytes, y_bytes))
    fitted = fit(points, activations=activations)
    assert fitted.median_error < 0.03
    assert fitted.x_bandwidth == pytest.approx(3e9, rel=0.2) and fitted.y_bandwidth == pytest.approx(6e9, rel=0.2)
    for (flops, nbytes, _), (x_bytes, y_bytes) in zip(points, activations):
        assert fitted.predict_us(flops, nbytes, 0.0, x_bytes, y_bytes) == pytest.approx(
            truth.predict_us(flops, nbytes, 0.0, x_bytes, y_bytes), rel=0.08)
    plain = fit(points)
    assert plain.x_bandwidth == plain.y_bandwidth == 0 and plain.median_error > fitted.median_error
    assert Fit(1.0, 1.0, 2e10, 1.0, x_bandwidth=1e9).memory_us(8e6, 1e6, 5e6) == pytest.approx(400.0 + 1000.0)


def test_cpu_caches_and_the_boundaries_tried():
    caches = calibration.cpu_caches()
    assert all(level >= 1 and size > 0 and size == int(size) for level, size in caches.items())
    mib = 1 << 20
    assert calibration.cache_boundaries({1: 32768.0, 2: 1.0 * mib, 3: 32.0 * mib}) == [mib, 8 * mib, 16 * mib, 32 * mib]
    assert calibration.cache_boundaries({2: 2.0 * mib}) == [2 * mib] and calibration.cache_boundaries({}) == []


def test_the_cache_boundary_is_chosen_by_the_measurements():
    """Weights read fast up to 8 MiB (a share of a large L3), slowly beyond: of the boundaries
    tried, the calibration keeps the one its probes show."""
    mib = 1 << 20
    truth = Fit(overhead_us=15.0, rate=3e11, bandwidth=2e10, p=1.0, cache_bytes=8 * mib, cache_bandwidth=8e10)
    gen = torch.Generator().manual_seed(7)
    rows = []
    for n, k in ((256, 1024), (1024, 1024), (1536, 1536), (2048, 2048), (3072, 3072), (512, 4096)):
        for m in (1, 8, 64):
            w = Workload("dense", "float32", m, n, k)
            noise = 1 + 0.02 * float(torch.randn(1, generator=gen))
            rows.append({**vars(w), "us": truth.predict_us(*work(w)) * noise})
    fits = fit_measurements(rows, DEFAULT_SMS, cache_bytes=[mib, 8 * mib, 16 * mib, 32 * mib])
    assert fits["dense/float32"].cache_bytes == 8 * mib
    assert fits["dense/float32"].cache_bandwidth == pytest.approx(8e10, rel=0.25)
    # no cache regime in the data: no boundary is needed to explain it
    one_regime = Fit(overhead_us=15.0, rate=3e11, bandwidth=2e10, p=1.0)
    flat = [{**row, "us": one_regime.predict_us(*work(workload_from_row(row)))} for row in rows]
    assert fit_measurements(flat, DEFAULT_SMS, cache_bytes=[mib, 8 * mib])["dense/float32"].median_error < 0.01


def test_rows_of_retired_implementations_are_left_out_of_a_fit():
    """A calibration measured by an older sparsecc may hold rows of a kernel since retired (the
    streaming BSR kernel, "bsr-kernel-small"): fitting leaves them out, and pricing such a
    workload is refused."""
    truth = Fit(overhead_us=5.0, rate=3e11, bandwidth=2e10, p=1.0)
    rows = []
    for n, k in ((512, 512), (1024, 1024), (2048, 512)):
        for m in (1, 16, 64):
            w = Workload("dense", "float32", m, n, k)
            rows.append({**vars(w), "us": truth.predict_us(*work(w))})
            rows.append({**vars(w), "impl": "bsr-kernel-small", "dtype": "float16", "density": 0.1,
                         "block": [32, 32], "block_density": 0.1, "us": 3.0})
    fits = fit_measurements(rows, DEFAULT_SMS)
    assert set(fits) == {"dense/float32"} and fits["dense/float32"].median_error < 0.01
    with pytest.raises(ValueError, match="unknown implementation"):
        work(workload_from_row(rows[1]))


def test_steps_follow_the_ctas_and_their_loop():
    """A 64x16 block makes four times the steps of a 16x64 one in a quarter of the CTAs."""
    def bsr(block, m=16, n=4096):
        return Workload("bsr-kernel", "float16", m, n, 4096, density=0.1, block=block, block_density=0.1,
                        tile=(block[0], 64))
    tall, wide = steps(bsr((64, 16))), steps(bsr((16, 64)))
    assert tall == pytest.approx(0.1 * 4096 / 16) and wide == pytest.approx(0.1 * 4096 / 64)
    # more CTAs than resident slots: the steps of the waves add up
    assert steps(bsr((16, 64), m=2048)) == pytest.approx(wide * 4096 / 16 * 32 / (DEFAULT_SMS * 4))
    assert steps(Workload("dense", "float16", 16, 4096, 4096)) == 0.0
    # the CSR kernel splits K when its CTAs do not fill the SMs, which shortens each CTA's loop
    small, large = (steps(Workload("csr-kernel", "float16", m, 4096, 4096, density=0.05, tile=(64, t)))
                    for m, t in ((16, 16), (4096, 128)))
    assert 0 < small < 4096 / 64 and large > small


def test_m_profile_corrects_what_the_fit_misses_by_batch():
    """A path twice as slow at one batch size than its neighbours (MKL's BSR product at 8 rows)."""
    truth = Fit(overhead_us=20.0, rate=5e10, bandwidth=2e10, p=1.0)
    rows = []
    for n, k in ((512, 512), (1024, 1024), (2048, 512)):
        for m in (1, 4, 8, 16, 64):
            w = Workload("bsr", "float32", m, n, k, density=0.1, block=(32, 32), block_density=0.1)
            us = truth.predict_us(*work(w)) * (2.0 if m == 8 else 1.0)
            rows.append({**vars(w), "us": us})
    fits = fit_measurements(rows, DEFAULT_SMS)
    bsr = fits["bsr/float32"]
    assert set(bsr.m_profile) == {"1", "4", "8", "16", "64"}
    assert bsr.m_factor(8) / bsr.m_factor(16) == pytest.approx(2.0, rel=0.1)
    cal = Calibration(key="k", device="test", fits=fits)
    for row in rows:
        assert cal.predict_us(workload_from_row(row)) == pytest.approx(row["us"], rel=0.1)
    # between calibrated Ms: log-linear; beyond them: flat
    profile = Fit(1.0, 1.0, 1.0, 1.0, m_profile={"1": 1.0, "16": 2.0})
    assert profile.m_factor(4) == pytest.approx(2 ** 0.5) and profile.m_factor(1000) == 2.0
    assert Fit(1.0, 1.0, 1.0, 1.0).m_factor(8) == 1.0


def test_work_counts_what_each_implementation_does():
    dense = Workload("dense", "float16", 2048, 4096, 4096)
    flops, nbytes = work(dense)
    assert flops == 2 * 2048 * 4096 * 4096 and nbytes == (4096 * 4096 + 2 * 2048 * 4096) * 2
    # a full wave of whole tiles: half of dense's flops, 9/16 of its weight bytes
    sparse = Workload("sparse24-gemm", "float16", 128 * 12, 128 * 11, 4096, density=0.5, tile=(128, 128))
    flops, nbytes = work(sparse)
    assert flops == 128 * 12 * 128 * 11 * 4096 and nbytes == 128 * 11 * 4096 * 2 * 9 / 16 + (128 * 12 * (4096 + 128 * 11)) * 2
    # one tile more than a wave costs a whole wave
    ragged = Workload("sparse24-gemm", "float16", 128 * 12, 128 * 11 + 1, 4096, density=0.5, tile=(128, 128))
    assert work(ragged)[0] == pytest.approx(2 * flops, rel=1e-9)
    # sparse flops scale with what is stored
    csr = [work(Workload("csr", "float32", 64, 1024, 1024, density=d))[0] for d in (0.1, 0.2)]
    assert csr[1] == pytest.approx(2 * csr[0])
    bsr = work(Workload("bsr", "float32", 64, 1024, 1024, density=0.1, block=(32, 32), block_density=0.25))
    assert bsr[0] == pytest.approx(2 * 64 * 0.25 * 1024 * 1024)
    with pytest.raises(ValueError, match="unknown implementation"):
        work(Workload("magic", "float16", 1, 1, 1))


@pytest.mark.parametrize("pattern,density", [("2:4", 0.5), ("1:8", 0.125), ("block32", 0.25),
                                             ("block16x64", 0.1), ("unstructured", 0.05), ("dense", 1.0)])
def test_random_weights_have_their_pattern(pattern, density):
    gen = torch.Generator().manual_seed(5)
    weight = random_weight(256, 512, pattern, density, torch.float32, "cpu", gen)
    stats = analyze(weight)
    if ":" in pattern:
        n, m = (int(v) for v in pattern.split(":"))
        assert stats.nm_min_n[m] == n and stats.density == pytest.approx(n / m)
    elif pattern.startswith("block"):
        h, w = (32, 32) if pattern == "block32" else (16, 64)
        assert stats.block_density[(h, w)] == pytest.approx(stats.density)      # whole blocks kept
        assert abs(stats.density - density) < 0.06
    else:
        assert abs(stats.density - density) < 0.01
    assert weight.abs().min() == 0 or pattern == "dense"
    assert (weight[weight != 0].abs() >= 1e-3).all()                             # kept values are not tiny


def _calibration(fits, borrowed=False):
    return Calibration(key="k", device="test", fits=fits, borrowed=borrowed)


def test_json_round_trip_and_version_check():
    original = _calibration({"dense/float32": Fit(10.0, 1e11, 2e10, 2.0, points=3, median_error=0.1,
                                                        m_profile={"1": 0.9, "64": 1.2}),
                             "bsr-kernel/16bit": Fit(5.0, 1e14, 2e12, 1.0, step_us=0.3)})
    loaded = Calibration.from_json(original.to_json())
    assert loaded.fits == original.fits and loaded.key == "k" and not loaded.borrowed
    w = Workload("dense", "float32", 8, 64, 64)
    dense = original.fits["dense/float32"]
    assert loaded.predict_us(w) == pytest.approx(dense.predict_us(*work(w)) * dense.m_factor(8))
    assert loaded.predict_us(Workload("csr", "float32", 8, 64, 64, density=0.1)) is None
    with pytest.raises(ValueError, match="version"):
        Calibration.from_json(original.to_json().replace('"version": 1', '"version": 99'))


def test_cache_packaged_fallback_and_corrupt_entry(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    packaged = for_device("cpu")
    assert packaged is not None and packaged.borrowed and "dense/float32" in packaged.fits
    assert for_device("cuda").borrowed and "sparse24-gemm/16bit" in for_device("cuda").fits
    own = _calibration({"dense/float32": Fit(1.0, 1e11, 1e10, 2.0)})
    path = save(own, torch.device("cpu"))
    assert path == cache_path(torch.device("cpu")) and path.parent.stat().st_mode & 0o077 == 0
    mine = for_device("cpu")
    assert not mine.borrowed and mine.fits == own.fits
    path.write_text("{ not json")
    with caplog.at_level("WARNING", logger="sparsecc"):
        assert for_device("cpu").borrowed
    assert "unreadable calibration" in caplog.text


def test_calibrating_this_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    probes = [calibration.Probe(n, k, "dense", 1.0, "dense", m, "float32") for n, k in ((256, 256), (512, 1024))
              for m in (1, 32, 256)]
    probes += [calibration.Probe(512, 512, "unstructured", d, "csr", m, "float32") for d in (0.2, 0.02) for m in (1, 64)]
    monkeypatch.setattr(calibration, "calibration_workloads", lambda device: probes)
    result = calibration.calibrate("cpu", progress=False)
    assert set(result.fits) == {"dense/float32", "csr/float32"}
    assert len(result.measurements) == len(probes) and all(r["us"] > 0 for r in result.measurements)
    assert not for_device("cpu").borrowed
    assert result.reference_us > 0          # the speed of this CPU the probes saw
    for found in result.fits.values():
        assert found.overhead_us > 0 and found.rate > 0 and found.bandwidth > 0 and 1 <= found.p <= 8
        assert math.isfinite(found.median_error)


def test_the_gpu_probes_kernels_are_listed_for_one_parallel_build():
    """Every kernel a GPU probe packs its weight for is in ``probe_kernels``, so a fresh machine
    compiles them in one build before timing."""
    from sparsecc.codegen.spec import Family, KernelSpec
    from sparsecc.ir.formats import FormatSpec
    from sparsecc.kernels import bsr, csr, sparse24_small
    probes = calibration.calibration_workloads(torch.device("cuda"))
    listed = set(calibration.probe_kernels(probes))
    needed = set()
    for p in probes:
        if p.dtype == "float32":
            continue
        dtype, spec = getattr(torch, p.dtype), FormatSpec.parse(p.format)
        if p.format == "2:4":
            family = sparse24_small.choose(p.dtype, (p.n, p.k), p.m)   # CUDA cores at M=1, then tensor cores
            needed |= {launch.spec for _, launch in family.dispatch(dtype, (p.n, p.k))}
            if family is sparse24_small.GEMM:
                needed.add(KernelSpec(Family.SM90_COMPRESS24, p.dtype))
        elif spec.kind == "bsr":
            needed |= {launch.spec for _, launch in bsr.dispatch(dtype, spec.block)}
        elif spec.kind == "csr":
            capacity = csr.expected_capacity(p.density)
            needed |= {launch.spec for _, launch in csr.dispatch(dtype, capacity)}
    assert needed and needed <= listed


def test_no_kernels_are_built_for_a_cpu_calibration(monkeypatch):
    monkeypatch.setattr(calibration, "ensure", lambda *a, **k: pytest.fail("a CPU calibration built kernels"))
    calibration.prebuild_kernels(calibration.calibration_workloads(torch.device("cpu")), torch.device("cpu"),
                                 progress=False)
