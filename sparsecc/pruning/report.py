"""What sparsecc.prune did: per layer, the pattern, the shape, and what was kept."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerReport:
    """One selected layer.

    ``shape`` is the canonical [out, in]. ``density_before``/``density`` are the fractions
    of non-zero weights before and after pruning; ``magnitude_kept`` is the fraction of the
    weight's L1 norm (sum of |w|) that survived. ``skipped`` holds the reason when the
    pattern could not be applied to this layer's shape (the layer is then left unchanged).
    """

    name: str
    pattern: str
    shape: tuple[int, int]
    density_before: float
    density: float
    magnitude_kept: float
    numel: int
    skipped: str | None = None


class LayersByName:
    """What a report of per-layer entries offers: ``report[name]``, iteration and length over its
    ``layers``, and ``str(report)`` as its ``table()``."""

    layers: list

    def __getitem__(self, name: str):
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __str__(self) -> str:
        return self.table()


@dataclass
class PruneReport(LayersByName):
    """The result of :func:`sparsecc.pruning.prune`; ``report[name]`` gives one layer."""

    pattern: str
    scope: str
    #: what chose the kept weights: "magnitude", "wanda" or a custom callable's name
    criterion: str = "magnitude"
    layers: list[LayerReport] = field(default_factory=list)
    #: 2-D weights prune did not touch though no include/exclude left them out, and why
    not_pruned: dict[str, str] = field(default_factory=dict)
    #: weights pruned along with a pruned layer because they are the same tensor (tied), by layer
    tied: dict[str, list[str]] = field(default_factory=dict)

    @property
    def pruned(self) -> list[LayerReport]:
        return [layer for layer in self.layers if layer.skipped is None]

    @property
    def skipped(self) -> list[LayerReport]:
        return [layer for layer in self.layers if layer.skipped is not None]

    @property
    def density(self) -> float:
        """Non-zero fraction over all pruned layers together (weighted by size)."""
        total = sum(layer.numel for layer in self.pruned)
        return sum(layer.density * layer.numel for layer in self.pruned) / total if total else 1.0

    def table(self) -> str:
        """A readable text table, one line per layer and a total."""
        header = ("layer", "shape", "pattern", "density before", "density", "|w| kept", "note")
        rows = [(layer.name or "<model>", f"{layer.shape[0]}x{layer.shape[1]}", layer.pattern,
                 f"{layer.density_before:.4f}", f"{layer.density:.4f}",
                 f"{layer.magnitude_kept:.4f}", f"skipped: {layer.skipped}" if layer.skipped else "")
                for layer in self.layers]
        rows.append((f"total ({len(self.pruned)} pruned)", "", f"{self.pattern} ({self.scope}, {self.criterion})",
                     "", f"{self.density:.4f}", "", ""))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                 for row in [header, *rows]]
        lines += [f"{layer}: pruned with it, the same tensor (tied): {', '.join(others)}"
                  for layer, others in self.tied.items()]
        lines += [f"not pruned: {name}: {why}" for name, why in self.not_pruned.items()]
        return "\n".join(line.rstrip() for line in lines)

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable)."""
        return {"pattern": self.pattern, "scope": self.scope, "criterion": self.criterion, "density": self.density,
                "layers": [{**asdict(layer), "shape": list(layer.shape)} for layer in self.layers],
                "not_pruned": dict(self.not_pruned), "tied": dict(self.tied)}
