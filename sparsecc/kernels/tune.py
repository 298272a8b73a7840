"""Which launch runs a tunable kernel family fastest, per (N, K, dtype, M bucket), on this GPU.

Tuning is the product's: for a weight shape and batch bucket a plan needs, :func:`ensure_tuned`
times every launch candidate of the family (:meth:`KernelFamily.candidates`) on a random weight
in the family's layout, as the compiled model runs it (CUDA-graph replay, the calls cycling
through enough weight copies that the weight is read from memory, not the L2 cache), checks
each launch's result against the family's reference (an fp32 product), and keeps the fastest
right one (a launch that declines the shape, as CUTLASS's ``can_implement`` may, is left out).
A bucket is measured at its most rows but runs every batch size down to the bucket below, and a
launch can be fast at the top and slow lower down (a second tile of x holding only a few rows):
the :data:`FINALISTS` fastest are timed again at the bucket's fewest rows, and the one whose
slower end is nearest its end's fastest wins.
Winners are stored per GPU, torch, CUDA and sparsecc version in the cache directory
(``<SPARSECC_CACHE_DIR>/tuning/*.json``, written atomically under a lock, like the kernel
cache), so a shape is tuned once per machine.

A dispatch table takes, per bucket: the launch measured here at this exact shape; else the
shipped table's (``tuning.json``, measured on the benchmark shapes on an H100; only a default)
at this shape, or at the nearest shape it holds (log distance in N and K; at equal distance
this dtype's); else, for a bucket the shipped table predates, the launch of the bucket above it
(what ran those batches before); else the family's default launch.

``SPARSECC_TUNE`` (:mod:`sparsecc.config`): ``new`` (the default) tunes what has no
measurement here, ``all`` tunes again what a plan needs (once per process), ``off`` never
tunes. :data:`LOG` records what this process tuned and how long it took; the plan reports it.
"""
from __future__ import annotations

import importlib.resources
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from filelock import FileLock
from tqdm.auto import tqdm

from ..codegen.spec import Family
from ..config import settings
from ..errors import KernelBuildError
from ..ir.numerics import relative_error
from ..ir.workload import dtype_name
from ..runtime.cache_files import cache_file, machine_key, write_atomically
from ..runtime.kernel_op import ensure
from ..runtime.loader import KernelRunError
from ..runtime.timing import packed_runner, time_us
from .base import KernelFamily, Launch, finish_packing, kernels_unavailable

log = logging.getLogger("sparsecc")

SHIPPED = "tuning.json"
TABLE_VERSION = 1
#: the relative error against the fp32 product above which a launch computed a wrong result
#: and never wins, however fast
MAX_REL_ERR = {"float16": 3e-3, "bfloat16": 1e-2}
#: the launches fastest at a bucket's most rows that are timed again at its fewest
FINALISTS = 3


@dataclass
class Tuned:
    """One bucket tuned in this process: what won, in how many candidates, in how long."""

    family: str
    dtype: str
    n: int
    k: int
    m: int
    launch: str
    us: float
    candidates: int
    seconds: float


#: what this process tuned, oldest first
LOG: list[Tuned] = []


class TuningTable:
    """The shipped entries and, for one machine, the ones measured on it (see the module docstring)."""

    def __init__(self, shipped: list[dict], path: Path | None = None, key: str = ""):
        self.shipped = shipped
        self.path, self.key = path, key
        self.here: dict[tuple, dict] = {}
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if data.get("version") == TABLE_VERSION and data.get("key") == key:
                    self.here = {_key(e): e for e in data["entries"]}
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("ignoring the unreadable tuning table %s (%s): its shapes are tuned again", path, error)

    def shipped_at(self, template: Family, m: int) -> bool:
        """Whether the shipped table measured ``template`` at ``m`` rows (on any shape)."""
        return any(e["family"] == template.value and e["M"] == m for e in self.shipped)

    def measured_here(self, template: Family, dtype: str, m: int, n: int, k: int) -> dict | None:
        return self.here.get((template.value, dtype, m, n, k))

    def best(self, template: Family, dtype: str, m: int, n: int, k: int) -> tuple[Launch, float, str] | None:
        """``(launch, microseconds, where from)`` for ``template`` at this shape and M: measured
        here, else the shipped table's at the nearest shape (None where neither has this M).
        A clustered launch borrowed from another shape keeps its tiling, not its cluster size,
        which depends on the shape: the kernel picks that (splits 0)."""
        own = self.measured_here(template, dtype, m, n, k)
        if own is not None:
            return Launch.from_description(own), own["us"], "tuned here"
        entries = [e for e in self.shipped if e["family"] == template.value and e["M"] == m]
        if not entries:
            return None

        def distance(entry):
            return (math.log(entry["N"] / n) ** 2 + math.log(entry["K"] / k) ** 2, entry["dtype"] != dtype)

        nearest = min(entries, key=distance)
        launch = Launch.from_description(nearest, dtype=dtype)
        same_shape = (nearest["N"], nearest["K"]) == (n, k)
        if template.clustered and not same_shape:
            launch = Launch(launch.spec, launch.swizzle, splits=0)
        where = "shipped table" if same_shape else f"shipped table, nearest shape {nearest['N']}x{nearest['K']}"
        return launch, nearest["us"], where

    def record(self, entries: list[dict]) -> None:
        """Add measured entries and save them: merged under a lock with what another process may
        have written meanwhile, then published with one atomic rename."""
        self.here.update({_key(e): e for e in entries})
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with FileLock(self.path.with_suffix(".lock")):
                merged = dict(self.here)
                if self.path.is_file():
                    try:
                        data = json.loads(self.path.read_text())
                        if data.get("version") == TABLE_VERSION and data.get("key") == self.key:
                            merged = {**{_key(e): e for e in data["entries"]}, **self.here}
                    except (OSError, ValueError, KeyError, TypeError):
                        pass
                write_atomically(self.path, json.dumps({"version": TABLE_VERSION, "key": self.key,
                                                        "entries": sorted(merged.values(), key=_key)}, indent=1))
                self.here = merged
        except OSError as error:
            log.warning("could not save the tuning table %s (%s): the shapes tuned now are tuned again "
                        "in the next process", self.path, error)


def _key(entry: dict) -> tuple:
    return entry["family"], entry["dtype"], entry["M"], entry["N"], entry["K"]


def shipped_entries() -> list[dict]:
    resource = importlib.resources.files("sparsecc.kernels") / SHIPPED
    return json.loads(resource.read_text())["entries"] if resource.is_file() else []


_TABLES: dict[tuple[str, str], TuningTable] = {}
_override: TuningTable | None = None


def table() -> TuningTable:
    """The table in use: one set with :func:`use`, else the shipped one with this GPU's
    measurements (only the shipped one without a GPU)."""
    if _override is not None:
        return _override
    key = machine_key(torch.device("cuda")) if torch.cuda.is_available() else "no GPU"
    cache_dir = str(settings().cache_dir)
    if (key, cache_dir) not in _TABLES:
        path = cache_file("tuning", key) if torch.cuda.is_available() else None
        _TABLES[(key, cache_dir)] = TuningTable(shipped_entries(), path, key)
    return _TABLES[(key, cache_dir)]


def use(new_table: TuningTable | None) -> None:
    """Use ``new_table`` for this process (tests, benchmarks); None restores the default."""
    global _override
    _override = new_table


def entry(template: Family, dtype: str, m: int, n: int, k: int, launch: Launch, us: float) -> dict:
    """A table entry for ``launch`` measured at this shape."""
    return {"family": template.value, "dtype": dtype, "M": m, "N": n, "K": k, "us": us, **launch.describe()}


_TUNED_THIS_PROCESS: set[tuple] = set()
#: the families whose tuning found its kernels could not be built, warned of once per process: a
#: machine without a CUDA compiler meets it at every shape and bucket (its kernel directories'
#: launches still run, from the shipped table)
_UNBUILT_WARNED: set[str] = set()


def ensure_tuned(family: KernelFamily, dtype: torch.dtype, shape: tuple[int, int], ms: Iterable[int], *,
                 device: torch.device | str = "cuda", progress: bool = True) -> None:
    """Tune ``family`` at this shape for each bucket M in ``ms`` that ``SPARSECC_TUNE`` says to
    (see the module docstring); nothing where the kernels cannot run."""
    mode = settings().tune
    if mode == "off" or not family.tunable or kernels_unavailable(device) is not None:
        return
    name = dtype_name(dtype)
    template = family.templates[0]
    for m in dict.fromkeys(ms):
        key = (family.name, name, m, *shape)
        if key in _TUNED_THIS_PROCESS or (mode == "new" and table().measured_here(template, name, m, *shape)):
            continue
        _TUNED_THIS_PROCESS.add(key)
        try:
            tune_bucket(family, dtype, shape, m, device=device, progress=progress)
        except KernelBuildError as error:
            first = family.name not in _UNBUILT_WARNED
            _UNBUILT_WARNED.add(family.name)
            log.log(logging.WARNING if first else logging.INFO,
                    "tuning %s at %dx%d, M=%d: its kernels did not build (%s); using the shipped table%s",
                    family.name, *shape, m, str(error).splitlines()[0],
                    " (its other shapes and batches alike: logged at INFO)" if first else "")


def fewest_rows(family: KernelFamily, m: int) -> int | None:
    """The fewest rows the bucket measured at ``m`` rows runs (one more than the bound below
    it), or None where that is ``m`` itself."""
    previous = 0
    for bound, measured in family.buckets:
        if bound == m or (bound == 0 and measured == m):
            return previous + 1 if previous + 1 < m else None
        previous = bound
    return None


def tune_bucket(family: KernelFamily, dtype: torch.dtype, shape: tuple[int, int], m: int, *,
                device: torch.device | str = "cuda", progress: bool = True,
                measure: Callable[[Launch, Callable[[], torch.Tensor]], float] | None = None) -> dict | None:
    """Time every candidate launch of ``family`` for ``m`` rows of a weight of this shape, the
    fastest again at the bucket's fewest rows (see the module docstring), and record the winner
    (``measure(launch, run) -> us`` replaces the GPU timing in tests; ``run.x`` has the rows).
    Returns the recorded entry, or None if no launch computed right."""
    start = time.perf_counter()
    device = torch.device(device)
    name, (n, k) = dtype_name(dtype), shape
    generator = torch.Generator(device).manual_seed(n * 131 + k)
    weight = family.tuning_weight(n, k, dtype, device, generator)
    launches = family.candidates(dtype, shape, m)
    ensure([launch.spec for launch in launches], progress=progress)
    packed = family.layout(weight)
    if device.type == "cuda":
        finish_packing(device)
    measure = measure or (lambda launch, run: time_us(run, device))

    def timed(launch: Launch, rows: int) -> float | None:
        """``launch``'s time at ``rows`` rows, or None (with a warning) where it declines the
        shape or computes a wrong result."""
        run = packed_runner(packed.running([(0, launch)]), rows, device, x_dtype=getattr(torch, launch.spec.dtype))
        with torch.no_grad():
            want = family.reference(run.x, weight)
            try:
                got = run()
            except (RuntimeError, KernelRunError) as refusal:   # it declined the shape (CUTLASS's can_implement)
                log.warning("tuning %s: %s does not run at %dx%d, M=%d (%s); it is left out",
                            family.name, launch.label, n, k, rows, str(refusal).splitlines()[0])
                return None
            error = relative_error(got.float(), want)
        if not error <= MAX_REL_ERR[name]:
            log.warning("tuning %s: %s computed a wrong result at M=%d (relative error %.3g); it is left out",
                        family.name, launch.label, rows, error)
            return None
        return measure(launch, run)

    description = f"sparsecc: tuning {family.name} {n}x{k} {name} M={m}"
    times = {launch: us for launch in tqdm(launches, desc=description, unit="launch", disable=not progress,
                                           leave=False) if (us := timed(launch, m)) is not None}
    if not times:
        return None
    best = fastest = min(times, key=times.get)
    low = fewest_rows(family, m)
    if low is not None and len(times) > 1:
        finalists = sorted(times, key=times.get)[:FINALISTS]
        at_low = {launch: us for launch in finalists if (us := timed(launch, low)) is not None}
        if at_low:
            fastest_low = min(at_low.values())
            best = min(at_low, key=lambda launch: max(times[launch] / times[fastest], at_low[launch] / fastest_low))
    found = entry(family.templates[0], name, m, n, k, best, round(times[best], 3))
    table().record([found])
    LOG.append(Tuned(family.name, name, n, k, m, best.label, round(times[best], 3), len(launches),
                     round(time.perf_counter() - start, 3)))
    return found


def log_since(start: int) -> list[dict]:
    """What was tuned since :data:`LOG` had ``start`` entries, as plain data (for a plan)."""
    return [asdict(t) for t in LOG[start:]]


def dispatch(family: KernelFamily, dtype: torch.dtype, shape: tuple[int, int],
             tune_range: tuple[int, int] | None = None, *, progress: bool = False) -> list[tuple[int, Launch]]:
    """A tunable family's dispatch table for a weight of this shape: per bucket the launch the
    table gives (see the module docstring), else the family's default; the buckets that meet
    ``tune_range`` are tuned first where ``SPARSECC_TUNE`` says to."""
    name = dtype_name(dtype)
    if tune_range is not None:
        ensure_tuned(family, dtype, shape, [m for _, m in family.buckets.meeting(*tune_range)], progress=progress)
    template = family.templates[0]
    entries, above = [], None                 # above: (measured M, launch) of the bucket above
    for bound, m in reversed(list(family.buckets)):
        found = table().best(template, name, m, *shape)
        if found:
            launch = found[0]
        elif above is not None and table().shipped_at(template, above[0]):
            launch = above[1]                 # a bucket newer than the shipped table: what ran its batches
        else:
            launch = family.default_launch(name, bound)
        entries.append((bound, launch))
        above = (m, launch)
    return entries[::-1]
