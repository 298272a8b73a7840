"""Every setting sparsecc reads from the environment, in one place, typed and documented.

Settings are read when :func:`settings` is called (not at import), so a test or a user can
change the environment at run time.

| variable                 | meaning                                                   | default                  |
|--------------------------|-----------------------------------------------------------|--------------------------|
| SPARSECC_CACHE_DIR       | where compiled kernels, tuned launches and calibrations are | $XDG_CACHE_HOME/sparsecc |
|                          | cached                                                     | (~/.cache/sparsecc)      |
| SPARSECC_LOG             | log level of the ``sparsecc`` logger (DEBUG, INFO, ...)    | WARNING                  |
| SPARSECC_NVCC            | the CUDA compiler to run                                   | nvcc on PATH             |
| SPARSECC_CUTLASS_DIR     | a CUTLASS ``include`` directory                            | from the nvidia-cutlass wheel |
| SPARSECC_BUILD_JOBS      | kernels compiled in parallel                               | number of CPUs           |
| SPARSECC_ON_BUILD_ERROR  | ``raise`` a KernelBuildError, or ``fallback`` to torch     | raise                    |
| SPARSECC_KERNELS         | generated kernel directories to load from (``:``-separated) | none                     |
| SPARSECC_LAUNCHER        | ``cpp`` (the C++ launch path) or ``python`` (the fallback)  | cpp                      |
| SPARSECC_NONFINITE       | ``propagate``: NaN/Inf of x reach y as in dense F.linear;  | propagate                |
|                          | ``unchecked``: 2:4 GEMM and BSR sites packed from now on   |                          |
|                          | skip that pass (faster; for inputs known to be finite)     |                          |
| SPARSECC_TUNE            | ``new``: time the launches of the shapes a plan needs that | new                      |
|                          | have no measurement on this GPU; ``all``: time them again; |                          |
|                          | ``off``: time nothing (this GPU's earlier measurements,    |                          |
|                          | else the shipped table's nearest shape)                    |                          |
| SPARSECC_OPT_IN          | kernel families compile may use beyond the default ones    | none                     |
|                          | (``,``-separated names: ``bitmap``)                        |                          |
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

_BUILD_ERROR_POLICIES = ("raise", "fallback")
_LAUNCHERS = ("cpp", "python")
_NONFINITE = ("propagate", "unchecked")
_TUNE = ("off", "new", "all")


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    log_level: int
    nvcc: str | None
    cutlass_dir: Path | None
    build_jobs: int
    on_build_error: str
    kernel_dirs: tuple[Path, ...] = ()
    launcher: str = "cpp"
    nonfinite: str = "propagate"
    tune: str = "new"
    opt_in: tuple[str, ...] = ()


def _cutlass_from_wheel() -> Path | None:
    """The CUTLASS include directory shipped in the ``nvidia-cutlass`` wheel, if installed."""
    try:
        import cutlass_library  # type: ignore[import-not-found]
    except ImportError:
        return None
    include = Path(cutlass_library.__file__).parent / "source" / "include"
    return include if (include / "cutlass" / "cutlass.h").is_file() else None


def settings() -> Settings:
    """Read and validate the environment."""
    env = os.environ
    level_name = env.get("SPARSECC_LOG", "WARNING").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise InputError(f"SPARSECC_LOG={level_name!r} is not a logging level "
                         "(use DEBUG, INFO, WARNING or ERROR)")
    policy = env.get("SPARSECC_ON_BUILD_ERROR", "raise").lower()
    if policy not in _BUILD_ERROR_POLICIES:
        raise InputError(f"SPARSECC_ON_BUILD_ERROR={policy!r}: use one of {_BUILD_ERROR_POLICIES}")
    launcher = env.get("SPARSECC_LAUNCHER", "cpp").lower()
    if launcher not in _LAUNCHERS:
        raise InputError(f"SPARSECC_LAUNCHER={launcher!r}: use one of {_LAUNCHERS}")
    nonfinite = env.get("SPARSECC_NONFINITE", "propagate").lower()
    if nonfinite not in _NONFINITE:
        raise InputError(f"SPARSECC_NONFINITE={nonfinite!r}: use one of {_NONFINITE}")
    tune = env.get("SPARSECC_TUNE", "new").lower()
    if tune not in _TUNE:
        raise InputError(f"SPARSECC_TUNE={tune!r}: use one of {_TUNE}")
    jobs_text = env.get("SPARSECC_BUILD_JOBS", "")
    try:
        jobs = int(jobs_text) if jobs_text else (os.cpu_count() or 1)
    except ValueError:
        raise InputError(f"SPARSECC_BUILD_JOBS={jobs_text!r} is not an integer") from None
    cutlass = env.get("SPARSECC_CUTLASS_DIR")
    return Settings(
        cache_dir=Path(env.get("SPARSECC_CACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                       / "sparsecc"),
        log_level=level,
        nvcc=env.get("SPARSECC_NVCC") or shutil.which("nvcc"),
        cutlass_dir=Path(cutlass) if cutlass else _cutlass_from_wheel(),
        build_jobs=max(1, jobs),
        on_build_error=policy,
        launcher=launcher,
        nonfinite=nonfinite,
        tune=tune,
        kernel_dirs=tuple(Path(p) for p in env.get("SPARSECC_KERNELS", "").split(os.pathsep) if p),
        opt_in=tuple(name.strip().lower() for name in env.get("SPARSECC_OPT_IN", "").split(",") if name.strip()),
    )


def configure_logging() -> logging.Logger:
    """The package logger, at the level SPARSECC_LOG asks for."""
    logger = logging.getLogger("sparsecc")
    logger.setLevel(settings().log_level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[sparsecc] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    return logger
