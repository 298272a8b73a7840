"""Quantize a model to FP8 before compiling it (a lossy step, kept apart from ``compile``).

    report = sparsecc.quantize(model, "fp8")                       # per-token input scales
    report = sparsecc.quantize(model, "fp8", calibration=batches)  # static input scales
    print(report.table())

Prune first to keep a sparse pattern: zeros quantize to zero, so 2:4 survives. Modules:
``linear`` (the FP8 layer), ``apply`` (quantize), ``report``; the numerics are
:mod:`sparsecc.ir.quant`.
"""
from .apply import quantize
from .linear import FP8Linear
from .report import LayerQuantReport, QuantReport

__all__ = ["quantize", "FP8Linear", "QuantReport", "LayerQuantReport"]
