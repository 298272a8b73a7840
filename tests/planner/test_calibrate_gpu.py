"""Calibration and site timing on the GPU: kernel times are positive and below the eager
cost, a calibration of a few probes fits, is cached for this GPU and predicts its own
measurements."""
import pytest
import torch
from torch import nn

import sparsecc
from sparsecc.ir.formats import FormatSpec
from sparsecc.ir.weights import random_weight
from sparsecc.kernels.base import kernels_unavailable
from sparsecc.planner import calibrate as calibrate_module
from sparsecc.planner.calibrate import Probe, calibrate
from sparsecc.planner.cost import site_runner
from sparsecc.planner.fit import cache_path, for_device, workload_from_row
from sparsecc.runtime.timing import time_us

from conftest import TOLERANCE, rel_error

pytestmark = pytest.mark.gpu


def test_graph_timing_reads_the_weight_from_memory():
    weight = random_weight(4096, 4096, "dense", 1.0, torch.float16, "cuda")
    run = site_runner(weight, FormatSpec.parse("dense"), 1)
    assert run.copies >= 4                       # 32 MiB of weight: copies exceed the L2 cache
    us = time_us(run, "cuda")
    # reading 32 MiB takes at least 32 MiB / 4 TB/s (above any H100's bandwidth)
    assert 32 * 2**20 / 4e12 * 1e6 < us < 1000


def test_calibration_fits_caches_and_predicts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    probes = [Probe(n, k, "dense", 1.0, "dense", m) for n, k in ((2048, 2048), (4096, 1024))
              for m in (1, 64, 1024)]
    probes += [Probe(2048, 2048, "unstructured", d, "csr", m) for d in (0.1, 0.01) for m in (1, 64)]
    monkeypatch.setattr(calibrate_module, "calibration_workloads", lambda device: probes)
    result = calibrate("cuda", progress=False)
    csr = "csr-kernel/16bit" if kernels_unavailable(torch.device("cuda")) is None else "csr/16bit"
    assert set(result.fits) == {"dense/16bit", csr} and len(result.measurements) == len(probes)
    assert cache_path(torch.device("cuda")).is_file()
    cached = for_device("cuda")
    assert not cached.borrowed and cached.key == result.key
    for row in result.measurements:
        predicted = result.predict_us(workload_from_row(row))
        assert 0.5 < predicted / row["us"] < 2.0, row


def test_compile_times_its_shortlist_on_the_gpu():
    """Without formats=, compile times each site's shortlisted formats (graph replay, as the
    model runs them) and keeps the fastest: at 10% of 64x64 blocks and M=16 a block format
    beats dense by far. The plan shows the timings; the model matches eager."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).half().cuda().eval()
    with torch.no_grad():
        for seed, layer in enumerate((model[0], model[2])):
            gen = torch.Generator("cuda").manual_seed(seed)
            layer.weight.copy_(random_weight(4096, 4096, "block64", 0.1, torch.float16, "cuda", gen))
    x = torch.randn(16, 4096, dtype=torch.float16, device="cuda")
    compiled = sparsecc.compile(model, (x,))
    for site in compiled.sparsecc_plan:
        timed = [c for c in site.candidates if c.measured_us is not None]
        assert site.choice.startswith("bsr") and "timed fastest" in site.reason, site.reason
        assert len(timed) >= 2 and any(c.format == "dense" for c in timed)
        assert min(timed, key=lambda c: c.measured_us).format == site.choice
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float16]
