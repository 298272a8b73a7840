"""sparsecc.quantize: replace the selected linear layers of a model by FP8 ones, in place, and say
what it cost.

Like ``prune``, this is an explicit, lossy step kept apart from ``compile``: it rounds weights
(and, on each call, inputs) to e4m3, and ``compile`` then runs exactly what the quantized model
computes. Numerics: :mod:`sparsecc.ir.quant`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..errors import InputError
from ..ir.quant import SCHEMES, amax_scale, quantize_input, quantize_weight
from ..pruning.selection import select_layers, weight_matrix
from .linear import FP8Linear
from .report import LayerQuantReport, QuantReport

#: the weight dtypes quantize takes
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ACTIVATIONS = ("dynamic", "static")


def quantize(model: nn.Module, scheme: str = "fp8", *, calibration: "Iterable | None" = None,
             activations: str | None = None, include: "str | Iterable[str] | None" = None,
             exclude: "str | Iterable[str] | None" = None) -> QuantReport:
    """Quantize the ``nn.Linear`` layers of ``model`` (and Hugging Face ``Conv1D``) in place to
    FP8 and return a report.

    Args:
        scheme: ``"fp8"``: e4m3 weights with one fp32 scale per output channel.
        calibration: batches the model is called with (each a tensor, a tuple of positional
            arguments or a dict of keyword arguments), run as the model is (``.eval()`` it first).
            They give each layer's static input scale, and the report's output errors.
        activations: ``"dynamic"`` (one scale per token, computed on each call) or ``"static"``
            (one scale per layer, the largest |input| the calibration batches gave it, over 448).
            Default: static when calibration batches are given, else dynamic.
        include, exclude: module-name globs (fnmatch), as for ``sparsecc.prune``.

    Zeros stay exactly zero, so a layer pruned to 2:4 keeps its 2:4 fit. Raises InputError for
    an unknown scheme, a model on the meta device, a selected weight that is not floating point
    (or holds NaN or Inf), or a static scale for a layer the calibration batches never called.
    """
    if scheme not in SCHEMES:
        raise InputError(f"unknown quantization scheme {scheme!r}: sparsecc.quantize takes {', '.join(SCHEMES)}")
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize needs an nn.Module, got {type(model).__name__}")
    activations = activations or ("static" if calibration is not None else "dynamic")
    if activations not in ACTIVATIONS:
        raise InputError(f"activations={activations!r}: use one of {ACTIVATIONS}")
    batches = _batches(calibration)
    if activations == "static" and not batches:
        raise InputError("static input scales need calibration batches: pass calibration=[batch, ...] "
                         "or activations='dynamic'")
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise InputError("the model has tensors on the meta device (no values): load its weights before quantizing")
    layers = select_layers(model, include=include, exclude=exclude)
    matrices = {name: _checked_matrix(name, module) for name, module in layers}
    quantized = {name: quantize_weight(matrix) for name, matrix in matrices.items()}
    scales: dict[str, torch.Tensor | None] = dict.fromkeys(matrices)
    if activations == "static":
        amax = _observe_amax(model, layers, batches)
        scales = {name: amax_scale(torch.tensor(amax[name], device=matrices[name].device)) for name in matrices}
    errors = _output_errors(model, layers, matrices, quantized, scales, batches) if batches else {}
    report = QuantReport(scheme=scheme, activations=activations, calibration_batches=len(batches))
    for name, module in layers:
        weight, weight_scale = quantized[name]
        report.layers.append(LayerQuantReport(
            name=name, shape=tuple(weight.shape), density=_density(weight),
            weight_error=_weight_error(matrices[name], weight, weight_scale), output_error=errors.get(name),
            input_scale=None if scales[name] is None else float(scales[name])))
        bias = getattr(module, "bias", None)
        _replace(model, name, FP8Linear(weight, weight_scale, scales[name], bias))
    return report


def _batches(calibration) -> list:
    if calibration is None:
        return []
    if isinstance(calibration, (torch.Tensor, dict)):
        raise InputError("calibration takes a list (or iterable) of batches, not one batch: pass [batch]")
    batches = list(calibration)
    if not batches:
        raise InputError("calibration=[] holds no batch")
    return batches


def _call(model: nn.Module, batch) -> None:
    """Run ``model`` on one calibration batch (a tensor, a tuple of arguments or a dict of keywords)."""
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def _run(model: nn.Module, layers, batches, hook) -> None:
    """Call ``hook(name, module, x)`` on every call of a selected layer while ``model`` runs ``batches``."""
    handles = [module.register_forward_pre_hook(lambda m, args, name=name: hook(name, m, args[0]))
               for name, module in layers]
    try:
        with torch.no_grad():
            for batch in batches:
                _call(model, batch)
    finally:
        for handle in handles:
            handle.remove()


def _observe_amax(model: nn.Module, layers, batches) -> dict[str, float]:
    """The largest |input| each selected layer sees over the calibration batches."""
    amax: dict[str, float] = {}

    def observe(name, module, x):
        amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().amax()) if x.numel() else 0.0)

    _run(model, layers, batches, observe)
    missing = [name for name, _ in layers if name not in amax]
    if missing:
        raise InputError(f"the calibration batches never call {missing[:5]}: a static input scale needs "
                         "observed inputs; exclude these layers or use activations='dynamic'")
    return amax


def _output_errors(model, layers, matrices, quantized, scales, batches) -> dict[str, float]:
    """Per layer, ``||y_q - y|| / ||y||`` over its calls in ``batches`` (fp64; see the report)."""
    sums: dict[str, list[float]] = {}

    def measure(name, module, x):
        matrix, (weight, weight_scale) = matrices[name], quantized[name]
        x2d = x.detach().reshape(-1, matrix.shape[1])
        bias = getattr(module, "bias", None)
        exact = x2d.double() @ matrix.double().t()
        x_q, x_scale = quantize_input(x2d, scales[name])
        approx = (x_q.double() @ weight.double().t()) * x_scale.double() * weight_scale.double()
        if bias is not None:
            exact = exact + bias.double()
            approx = approx + bias.to(x.dtype).double()
        total = sums.setdefault(name, [0.0, 0.0])
        total[0] += float(torch.linalg.vector_norm(approx - exact)) ** 2
        total[1] += float(torch.linalg.vector_norm(exact)) ** 2

    _run(model, layers, batches, measure)
    return {name: (diff ** 0.5 / ref ** 0.5 if ref else 0.0) for name, (diff, ref) in sums.items()}


def _checked_matrix(name: str, module: nn.Module) -> torch.Tensor:
    """The layer's weight as [out, in], refused where it cannot be quantized."""
    if not name:
        raise InputError("quantize replaces layers inside a model; the model itself is a linear layer: "
                         "wrap it, e.g. nn.Sequential(layer)")
    matrix = weight_matrix(module).detach()
    if matrix.dtype not in FLOAT_DTYPES:
        raise InputError(f"layer {name!r} has a {matrix.dtype} weight: quantize takes float32, float16, "
                         "bfloat16 or float64 weights (an already quantized layer is not quantized again)")
    if not bool(torch.isfinite(matrix).all()):
        raise InputError(f"layer {name!r} has NaN or Inf in its weight: it has no FP8 scale")
    return matrix


def _weight_error(matrix: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> float:
    """``||W - W_q * s_w|| / ||W||`` in fp64 (0 for a zero weight)."""
    reference = matrix.double()
    norm = float(torch.linalg.vector_norm(reference))
    error = float(torch.linalg.vector_norm(reference - weight.double() * scale.double()[:, None]))
    return error / norm if norm else 0.0


def _density(weight: torch.Tensor) -> float:
    """Non-zero fraction of an e4m3 weight (its zeros are all +0, so the bytes tell)."""
    return int(torch.count_nonzero(weight.view(torch.uint8))) / max(weight.numel(), 1)


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
