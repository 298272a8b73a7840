"""Per-machine cache files (sparsecc.runtime.cache_files): the key names the device and the
versions, the file name is safe, and a write is all or nothing."""
import torch

from sparsecc import __version__
from sparsecc.runtime.cache_files import cache_file, device_name, machine_key, write_atomically


def test_the_key_names_the_device_and_the_versions_and_makes_a_safe_file_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECC_CACHE_DIR", str(tmp_path))
    key = machine_key(torch.device("cpu"))
    assert key.startswith(device_name(torch.device("cpu"))) and f"torch {torch.__version__}" in key
    assert key.endswith(f"sparsecc {__version__}")
    path = cache_file("tuning", "NVIDIA H100 80GB HBM3|torch 2.11.0+cu130|cuda 13.0|sparsecc 0.1.0")
    assert path.parent == tmp_path / "tuning"
    assert path.name == "NVIDIA_H100_80GB_HBM3_torch_2.11.0_cu130_cuda_13.0_sparsecc_0.1.0.json"


def test_a_write_publishes_the_whole_file_in_a_private_folder(tmp_path):
    path = tmp_path / "new" / "table.json"
    write_atomically(path, "first")
    write_atomically(path, "second")
    assert path.read_text() == "second" and list(path.parent.iterdir()) == [path]
    assert path.parent.stat().st_mode & 0o077 == 0
