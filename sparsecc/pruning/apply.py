"""sparsecc.prune: make the selected layers of a model sparse, in place, and say what it did.

This is the lossy step sparsecc keeps apart from ``compile`` (which never changes what a
model computes): it zeroes weights so that each selected layer fits a pattern, and the
compiler then finds formats that represent those weights exactly.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from ..errors import InputError, PatternError
from .allocation import ALLOCATIONS, check_prune_scope
from .calibration import check_calibration
from .criteria import WANDA, criterion_masks, criterion_name
from .finetune import register_mask
from .masks import pattern_masks
from .patterns import Pattern, parse_pattern
from .report import LayerReport, PruneReport
from .selection import is_conv1d, select_layers, weight_matrix
from .wanda import wanda_scorer

Criterion = Callable[[str, torch.Tensor], torch.Tensor]

#: on a CPU, prune zeroes and measures a weight in row chunks of about this many elements
#: (2 MiB of float32: a chunk and its buffers stay in cache across the passes over it)
APPLY_CHUNK_ELEMENTS = 1 << 19
#: on other devices (a GPU), in chunks of about this many: few launches, bounded buffers
APPLY_CHUNK_ELEMENTS_ACCELERATOR = 1 << 22
#: the integer type of a float's size (by element size): non-zeros are counted, and a mask
#: applied, on a weight's bits viewed as these
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Measures(NamedTuple):
    """A weight's non-zeros and L1 norm (sum of |w|), before and after pruning."""

    nonzeros_before: int
    l1_before: float
    nonzeros: int
    l1: float


def prune(model: nn.Module, pattern: "str | Pattern", *,
          include: "str | Iterable[str] | None" = None,
          exclude: "str | Iterable[str] | None" = None,
          types: tuple[type, ...] = (nn.Linear,), keep_first: int = 0, keep_last: int = 0,
          scope: str = "layer", criterion: "str | Criterion" = "magnitude",
          keep_masks: bool = False, calibration: "Iterable | None" = None) -> PruneReport:
    """Prune the selected layers of ``model`` to ``pattern``, in place; return a report.

    Args:
        pattern: a pattern string (``"2:4"``, ``"3:32"``, ``"2:4/vw4"``, ``"2:4/bw32"``,
            ``"block32x32@0.25"``, ``"unstructured@0.1"``) or a pattern object; see
            :mod:`sparsecc.pruning.patterns`. Groups run along each layer's input dimension
            (dim 1 of an ``nn.Linear`` weight, dim 0 of a Hugging Face ``Conv1D`` weight).
        include, exclude: module-name globs (fnmatch; a string or a list) choosing layers.
        types: module types to prune; ``Conv1D`` counts as ``nn.Linear``.
        keep_first, keep_last: leave the first / last k selected layers (in
            ``model.named_modules()`` order) dense.
        scope: ``"layer"`` prunes each layer on its own; ``"global"`` ranks the units of all
            selected layers together (one threshold), for ``unstructured`` and ``block``;
            ``"erk"`` gives each layer its own density, more to small layers, keeping the
            pattern's density in total (:mod:`sparsecc.pruning.allocation`).
        criterion: ``"magnitude"`` (|w|, the default), ``"wanda"`` (|w| times the L2 norm of
            its input feature on ``calibration``; unstructured masks compare within each
            output row, see :mod:`sparsecc.pruning.criteria`) or a callable
            ``(name, weight) -> scores`` of the weight's stored shape, higher = keep.
        keep_masks: store each mask as a bool buffer ``weight_mask`` for fine-tuning (see
            :func:`sparsecc.pruning.attach_to_optimizer`).
        calibration: for ``criterion="wanda"`` only: an iterable of example inputs as the
            model is called (tensors, tuples, dicts), run once under no_grad before pruning.

    A layer whose shape the pattern cannot take (a block that does not divide it) is left
    dense; the report gives the reason and a warning names it. If no selected layer can
    take the pattern, PatternError is raised. An empty selection or a layer whose weight is
    not 2-D, or not float16, bfloat16, float32 or float64, raises InputError.
    """
    pattern = parse_pattern(pattern)
    check_prune_scope(pattern, scope)
    check_calibration(criterion, calibration)
    score_of = None if criterion == WANDA else _scorer(criterion)
    layers = select_layers(model, include=include, exclude=exclude, types=types,
                           keep_first=keep_first, keep_last=keep_last)
    report = PruneReport(pattern=str(pattern), scope=scope, criterion=criterion_name(criterion))
    prunable = []
    for name, module in layers:
        matrix = _checked_matrix(name, module)
        try:
            pattern.check_shape(tuple(matrix.shape))
            prunable.append((name, module, matrix))
        except PatternError as error:
            report.layers.append(_layer_report(name, pattern, matrix, _zero_and_measure(matrix),
                                               skipped=str(error)))
    if not prunable:
        raise PatternError(f"{pattern} fits none of the {len(layers)} selected layers: "
                           + "; ".join(f"{layer.name}: {layer.skipped}" for layer in report.layers))
    if report.skipped:
        warnings.warn(f"prune left {len(report.skipped)} layer(s) dense because {pattern} does not "
                      f"fit their shape: {', '.join(layer.name for layer in report.skipped)} "
                      "(see the report)", stacklevel=2)

    if criterion == WANDA:
        score_of = wanda_scorer(model, [(name, module) for name, module, _ in prunable], calibration)
    if criterion == WANDA or scope in ALLOCATIONS:
        masks = criterion_masks(pattern, prunable, score_of, scope, rows=criterion == WANDA)
    else:
        masks = _masks(pattern, prunable, score_of, scope)
    with torch.no_grad():
        for (name, module, matrix), mask in zip(prunable, masks):
            report.layers.append(_layer_report(name, pattern, matrix, _zero_and_measure(matrix, mask)))
            if keep_masks:
                register_mask(module, mask.t() if is_conv1d(module) else mask)
    order = {name: index for index, (name, _) in enumerate(layers)}
    report.layers.sort(key=lambda layer: order[layer.name])
    report.tied = _tied(model, [(name, module) for name, module, _ in prunable])
    if report.tied:
        warnings.warn("prune also pruned weights tied to a pruned layer (the same tensor): "
                      + "; ".join(f"{layer} -> {', '.join(others)}" for layer, others in report.tied.items())
                      + " (exclude= the layer to keep them dense)", stacklevel=2)
    tied_names = {name for others in report.tied.values() for name in others}
    report.not_pruned = {name: why for name, why in _not_pruned(model, types, include, exclude).items()
                         if name not in tied_names}
    return report


def _tied(model: nn.Module, pruned: list[tuple[str, nn.Module]]) -> dict[str, list[str]]:
    """Per pruned layer, the other parameter names of its weight tensor (e.g. an output layer
    tied to the embedding)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    found = {}
    for name, module in pruned:
        own = f"{name}.weight" if name else "weight"
        others = [n for n in names.get(id(module.weight), []) if n != own]
        if others:
            found[name or "<model>"] = others
    return found


def _not_pruned(model: nn.Module, types: tuple[type, ...], include, exclude) -> dict[str, str]:
    """2-D weights of modules prune does not take (not of ``types``), which include/exclude did
    not leave out: prune says so rather than leave them dense without a word."""
    found = {}
    globs_in, globs_out = _as_globs(include), _as_globs(exclude)
    for module_name, module in model.named_modules():
        if isinstance(module, types) or is_conv1d(module):
            continue
        if (globs_in and not any(fnmatch.fnmatch(module_name, g) for g in globs_in)) or \
                any(fnmatch.fnmatch(module_name, g) for g in globs_out):
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() == 2:
                full = f"{module_name}.{name}" if module_name else name
                found[full] = (f"{type(module).__name__}.{name} is not a layer prune takes "
                               f"({', '.join(t.__name__ for t in types)}; see types=)")
    return found


def _as_globs(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _masks(pattern: Pattern, prunable, score_of, scope: str) -> Iterator[torch.Tensor]:
    """The masks in layer order; one layer at a time (to bound memory) unless global."""
    magnitude = score_of is None

    def scores(name, module, matrix):
        return matrix if score_of is None else score_of(name, module)

    if scope == "global":
        yield from pattern_masks(pattern, [scores(*layer) for layer in prunable],
                                 magnitude=magnitude, scope="global")
    else:
        for layer in prunable:
            yield pattern_masks(pattern, [scores(*layer)], magnitude=magnitude)[0]


def _scorer(criterion) -> "Callable[[str, nn.Module], torch.Tensor] | None":
    """None for magnitude (scored chunk by chunk inside the mask functions), else a function
    returning the criterion's scores in the canonical [out, in] orientation."""
    if criterion == "magnitude":
        return None
    if not callable(criterion):
        raise InputError(f"criterion must be 'magnitude', 'wanda' or a callable (name, weight) -> scores, "
                         f"got {criterion!r}")

    def score_of(name: str, module: nn.Module) -> torch.Tensor:
        scores = criterion(name, module.weight.detach())
        if not isinstance(scores, torch.Tensor) or scores.shape != module.weight.shape:
            raise InputError(f"criterion returned {type(scores).__name__}"
                             f"{tuple(getattr(scores, 'shape', ()))} for layer {name!r}; it must "
                             f"return scores of the weight's shape {tuple(module.weight.shape)}")
        return scores.t() if is_conv1d(module) else scores

    return score_of


def _checked_matrix(name: str, module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InputError(f"layer {name!r} ({type(module).__name__}) has no 2-D weight (got "
                         f"{tuple(getattr(weight, 'shape', ())) if weight is not None else None}); "
                         "prune handles [out, in] weights (nn.Linear, Hugging Face Conv1D): leave "
                         "it out with types= or exclude=")
    if not weight.is_floating_point() or weight.element_size() not in _SAME_SIZE_INT:
        raise InputError(f"layer {name!r} has a {weight.dtype} weight; prune handles float16, "
                         "bfloat16, float32 and float64 weights: convert the model first, or "
                         "leave the layer out with exclude=")
    return weight_matrix(module)


@torch.no_grad()
def _zero_and_measure(matrix: torch.Tensor, keep: "torch.Tensor | None" = None) -> _Measures:
    """Zero ``matrix`` in place where ``keep`` is False (None: leave it as it is) and return
    its non-zeros and L1 norm before and after, in one pass over it.

    Zeroing is what ``masked_fill_(~keep, 0)`` does, bit for bit: a dropped weight becomes
    +0.0 (a NaN or a -0.0 too) and a kept one keeps its bits. Counts are exact. An L1 norm is
    summed in float32 within a chunk (torch's cascade sum) and in float64 across chunks
    (float64 throughout for a float64 weight): within about 1e-7 of an fp64 sum, far below
    the report's four decimals.

    Why one pass of its own: ``masked_fill_`` and ``count_nonzero`` on a float weight branch
    on every element, which a pruning mask makes unpredictable (over 1 ns a weight on one
    core, each); ``~keep`` and float copies of a whole weight are fresh memory (a page fault
    every 4 KiB); and each such call streams the weight from memory again. Together they took
    longer than choosing the mask. Here the weight goes by in row chunks of about
    ``APPLY_CHUNK_ELEMENTS`` (on a CPU a chunk stays in cache across its passes) through
    buffers made once; |w| is taken once per chunk, non-zeros are counted on its bits (|w|
    has no -0.0, and a NaN's bits are not zero) and the mask is applied as an integer product
    of the bits with 1 (kept) or 0 (dropped): branch-free, vectorised ops. Everything runs on
    the weight's device; the totals are read back at the end.
    """
    if not matrix.is_contiguous() and matrix.t().is_contiguous():   # Conv1D: walk storage order
        matrix, keep = matrix.t(), None if keep is None else keep.t()
    rows = max(1, _chunk_elements(matrix.device) // max(1, matrix.shape[1]))
    magnitude_dtype = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    buffers: dict[torch.dtype, torch.Tensor] = {}

    def buffer(dtype: torch.dtype, rows_now: int) -> torch.Tensor:
        if dtype not in buffers:     # the first chunk is the largest
            buffers[dtype] = torch.empty(rows_now, matrix.shape[1], dtype=dtype, device=matrix.device)
        return buffers[dtype][:rows_now]

    before, after = [], []
    for start in range(0, matrix.shape[0], rows):
        weights = matrix[start:start + rows]
        magnitudes = buffer(magnitude_dtype, weights.shape[0])
        if magnitudes.dtype == weights.dtype:
            torch.abs(weights, out=magnitudes)
        else:
            magnitudes.copy_(weights).abs_()
        before.append(_nonzeros_and_sum(magnitudes))
        if keep is None:
            continue
        ones = {}                                              # 1 kept, 0 dropped
        for target in (magnitudes, weights):
            bits = _SAME_SIZE_INT[target.element_size()]
            if bits not in ones:
                ones[bits] = buffer(bits, weights.shape[0]).copy_(keep[start:start + rows])
            target.view(bits).mul_(ones[bits])
        after.append(_nonzeros_and_sum(magnitudes))
    before_totals = _totals(before)
    return _Measures(*before_totals, *(_totals(after) if keep is not None else before_totals))


def _nonzeros_and_sum(magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of ``magnitudes`` (|w|, float32 or float64) are non-zero, and their sum."""
    bits = magnitudes.view(_SAME_SIZE_INT[magnitudes.element_size()])
    return torch.count_nonzero(bits), magnitudes.sum()


def _totals(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, float]:
    """The counts and sums of the chunks, added up (sums in float64), read back once."""
    if not chunks:
        return 0, 0.0
    counts, sums = zip(*chunks)
    return int(torch.stack(counts).sum()), float(torch.stack(sums).double().sum())


def _chunk_elements(device: torch.device) -> int:
    return APPLY_CHUNK_ELEMENTS if device.type == "cpu" else APPLY_CHUNK_ELEMENTS_ACCELERATOR


def _layer_report(name: str, pattern: Pattern, matrix: torch.Tensor, measures: _Measures, *,
                  skipped: str | None = None) -> LayerReport:
    """One layer's report from its weight's measures before and after pruning."""
    numel = matrix.numel()
    return LayerReport(
        name=name, pattern=str(pattern), shape=tuple(matrix.shape), numel=numel,
        density_before=measures.nonzeros_before / numel if numel else 0.0,
        density=measures.nonzeros / numel if numel else 0.0,
        magnitude_kept=measures.l1 / measures.l1_before if measures.l1_before else 1.0,
        skipped=skipped)
