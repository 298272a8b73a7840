"""What sparsecc keeps per machine besides kernels (tuned launches, calibrations): which machine a
file is for, where it lives in the cache directory, and how it is written (atomically)."""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

from .._version import __version__
from ..config import settings


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture, cores and torch threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def machine_key(device: torch.device) -> str:
    """What a measurement is valid for: the device and the torch, CUDA and sparsecc versions."""
    return f"{device_name(device)}|torch {torch.__version__}|cuda {torch.version.cuda}|sparsecc {__version__}"


def cache_file(kind: str, key: str) -> Path:
    """``<cache dir>/<kind>/<key as a file name>.json``."""
    return settings().cache_dir / kind / (re.sub(r"[^A-Za-z0-9.]+", "_", key).strip("_") + ".json")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a private file published by one rename, so a reader
    sees the old file or the new one, never a part; the folder is made 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(text)
    staging.replace(path)
