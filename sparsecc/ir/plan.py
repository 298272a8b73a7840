"""The plan: per site, what was measured, what was considered, what was chosen and why.

A plan is plain data. ``table()`` prints it for a person, ``to_json()``/``from_json()``
save and load it, and ``sparsecc.compile(..., plan=plan)`` replays its choices.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .._version import __version__
from ..errors import PlanError

PLAN_VERSION = 1
#: a site's ``above`` where the batches past its small-batch kernels' rows run its dense weight
ABOVE_DENSE = "dense"


@dataclass
class Candidate:
    format: str
    predicted_us: float
    nbytes: int
    measured_us: float | None = None


@dataclass
class SitePlan:
    name: str                    # weight's qualified name in the model (+ "#k" if reused)
    module_path: str             # the traced module that holds the site
    shape: list[int]             # [N, K]
    dtype: str
    m: int | None                # rows seen with the example inputs
    epilogue: str                # e.g. "bias+gelu+T"
    density: float
    fits: list[str]              # tightest n:m patterns the weight fits
    block_density: dict[str, float]
    candidates: list[Candidate]
    choice: str
    reason: str
    bytes_before: int
    bytes_after: int
    buckets: list[dict] = field(default_factory=list)
    m_range: list[int] | None = None    # the declared batch range the choice covers
    #: what runs the batches past the low-end kernels' rows where a 2:4 or block-sparse site's range
    #: reaches beyond them (sparsecc.kernels.by_rows): None (the choice's own kernels: 2:4's GEMMs,
    #: BSR's) or ABOVE_DENSE (timed faster there than the sparse format)
    above: str | None = None
    #: where one call computes this site with others that read the same input in the same format
    #: (sparsecc.ir.siblings): their names joined by '+', in graph order
    group: str | None = None

    @property
    def label(self) -> str:
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name


@dataclass
class Plan:
    sites: list[SitePlan]
    device: str
    torch_version: str = torch.__version__
    sparsecc_version: str = __version__
    untraced: dict[str, str] = field(default_factory=dict)
    version: int = PLAN_VERSION
    #: the launches tuned on this GPU while planning and packing (sparsecc.kernels.tune.Tuned)
    tuning: list[dict] = field(default_factory=list)
    #: microseconds per call on the example inputs, with the sparse layers and dense, where the
    #: whole model (or graph) was timed both ways before one was kept (sparsecc.planner.check)
    checked: list[float] | None = None

    def __iter__(self):
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def __getitem__(self, name: str) -> SitePlan:
        for site in self.sites:
            if site.name == name or site.label == name:
                return site
        raise KeyError(name)

    def _by_weight(self) -> list[SitePlan]:
        """One site per weight: a weight used at several sites (``name#2``, ...) counts once."""
        return list({s.name.split("#")[0]: s for s in self.sites}.values())

    @property
    def bytes_before(self) -> int:
        return sum(s.bytes_before for s in self._by_weight())

    @property
    def bytes_after(self) -> int:
        return sum(s.bytes_after for s in self._by_weight())

    def choices(self) -> dict[str, str]:
        return {s.name: s.choice for s in self.sites}

    def table(self) -> str:
        """A readable per-site table, then the reasons and anything left untraced."""
        header = ["layer", "N x K", "dtype", "M", "epilogue", "density", "fits",
                  "candidates (predicted us)", "choice", "bytes before -> after"]
        rows = []
        for s in self.sites:
            cands = ", ".join(f"{c.format}={c.predicted_us:.1f}" + (f"(meas {c.measured_us:.1f})" if c.measured_us else "")
                              for c in s.candidates) or "-"
            rows.append([s.label, f"{s.shape[0]}x{s.shape[1]}", s.dtype, str(s.m or "?"), s.epilogue,
                         f"{s.density:.3f}", " ".join(s.fits) or "-", cands, s.choice,
                         f"{_size(s.bytes_before)} -> {_size(s.bytes_after)}"])
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        lines = [f"sparsecc plan for {self.device}: {len(self.sites)} linear site(s), weights "
                 f"{_size(self.bytes_before)} -> {_size(self.bytes_after)}"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        if self.sites:
            lines.append("")
            lines += [f"{s.label}: {s.choice} -- {s.reason}" + _shared_call(s) for s in self.sites]
        for path, why in self.untraced.items():
            lines.append(f"untraced {path}: {why}")
        if self.checked:
            lines.append(f"timed as a whole on the example inputs: {self.checked[0]:.0f} us per call with the sparse "
                         f"layers, {self.checked[1]:.0f} us dense")
        if self.tuning:
            seconds = sum(t["seconds"] for t in self.tuning)
            lines.append(f"tuned on this GPU: {len(self.tuning)} launch choice(s) in {seconds:.1f} s")
            lines += [f"  {t['family']} {t['n']}x{t['k']} {t['dtype']} M={t['m']}: {t['launch']} {t['us']:.1f} us "
                      f"({t['candidates']} candidates, {t['seconds']:.1f} s)" for t in self.tuning]
        return "\n".join(lines)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(asdict(self), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> "Plan":
        """Load a plan from a JSON string or a file path."""
        text = Path(source).read_text() if isinstance(source, Path) or not str(source).lstrip().startswith("{") else source
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
                found = data.get("version") if isinstance(data, dict) else type(data).__name__
                raise PlanError(f"not a sparsecc plan of version {PLAN_VERSION} (found {found!r})")
            sites = [SitePlan(**{**s, "candidates": [Candidate(**c) for c in s["candidates"]]})
                     for s in data.pop("sites")]
            return cls(sites=sites, **data)
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise PlanError(f"not a sparsecc plan: {type(error).__name__}: {error}") from error


def _shared_call(site: SitePlan) -> str:
    """What the table says of a site that one call computes with others."""
    if not site.group:
        return ""
    others = [name for name in site.group.split("+") if name != site.name]
    return f"; computed in one call with {', '.join(others)} (their weights stacked)"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes}"
