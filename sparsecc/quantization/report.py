"""What sparsecc.quantize did: per layer, the shape and the error quantization introduced."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..pruning.report import LayersByName


@dataclass(frozen=True)
class LayerQuantReport:
    """One quantized layer.

    ``weight_error`` is ``||W - W_q * s_w|| / ||W||`` (Frobenius norms, fp64). ``output_error``,
    when calibration batches were given, is ``||y_q - y|| / ||y||`` over every call of the layer
    in those batches, ``y`` the original layer's output and ``y_q`` the quantized layer's on the
    same input (both exact, fp64: the error of quantization alone, not of summation order).
    ``input_scale`` is the static input scale (None: per token, computed on each call).
    """

    name: str
    shape: tuple[int, int]
    density: float
    weight_error: float
    output_error: float | None = None
    input_scale: float | None = None


@dataclass
class QuantReport(LayersByName):
    """The result of :func:`sparsecc.quantization.quantize`; ``report[name]`` gives one layer."""

    scheme: str
    activations: str                 # "dynamic" or "static"
    layers: list[LayerQuantReport] = field(default_factory=list)
    calibration_batches: int = 0

    def table(self) -> str:
        """A readable text table, one line per layer."""
        header = ("layer", "shape", "density", "weight error", "output error", "input scale")
        rows = [(layer.name or "<model>", f"{layer.shape[0]}x{layer.shape[1]}", f"{layer.density:.4f}",
                 f"{layer.weight_error:.3e}",
                 "-" if layer.output_error is None else f"{layer.output_error:.3e}",
                 "per token" if layer.input_scale is None else f"{layer.input_scale:.4g}")
                for layer in self.layers]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"{self.scheme}: e4m3 weights, per-channel scales; {self.activations} input scales"
                 + (f"; errors on {self.calibration_batches} calibration batch(es)" if self.calibration_batches else "")]
        lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable)."""
        return {"scheme": self.scheme, "activations": self.activations,
                "calibration_batches": self.calibration_batches,
                "layers": [{**asdict(layer), "shape": list(layer.shape)} for layer in self.layers]}
