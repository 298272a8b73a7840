"""Calibration and site timing on the GPU: kernel times are positive and below the eager
cost, a calibration of a few probes fits, is cached for this GPU and predicts its own
measurements."""
import pytest
import torch

from sparsecc import calibration as calib
from sparsecc.formats import FormatSpec
from sparsecc.timing import site_runner, time_us

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graph_timing_reads_the_weight_from_memory():
    weight = calib.random_weight(4096, 4096, "dense", 1.0, torch.float16, "cuda")
    run = site_runner(weight, FormatSpec.parse("dense"), 1)
    assert run.copies >= 4                       # 32 MiB of weight: copies exceed the L2 cache
    us = time_us(run, "cuda")
    # reading 32 MiB takes at least 32 MiB / 4 TB/s (above any H100's bandwidth)
    assert 32 * 2**20 / 4e12 * 1e6 < us < 1000


def test_calibration_fits_caches_and_predicts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    probes = [calib.Probe(n, k, "dense", 1.0, "dense", m) for n, k in ((2048, 2048), (4096, 1024))
              for m in (1, 64, 1024)]
    probes += [calib.Probe(2048, 2048, "unstructured", d, "csr", m) for d in (0.1, 0.01) for m in (1, 64)]
    monkeypatch.setattr(calib, "calibration_workloads", lambda device: probes)
    result = calib.calibrate("cuda", progress=False)
    assert set(result.fits) == {"dense/16bit", "csr/16bit"} and len(result.measurements) == len(probes)
    assert calib.cache_path(torch.device("cuda")).is_file()
    cached = calib.for_device("cuda")
    assert not cached.borrowed and cached.key == result.key
    for row in result.measurements:
        predicted = result.predict_us(calib.workload_from_row(row))
        assert 0.5 < predicted / row["us"] < 2.0, row
