"""What decides which weights a prune keeps: the criterion, and masks for the cases beyond
plain magnitude at one density (those stay in :mod:`sparsecc.pruning.apply`).

Criteria: ``"magnitude"`` (|w|), ``"wanda"`` (|w| times its input feature's norm on
calibration data, :mod:`sparsecc.pruning.wanda`) or a callable ``(name, weight) -> scores``.
:func:`criterion_masks` covers Wanda (whose unstructured masks compare within each output
row) and ``scope="erk"`` (each layer its own density, :mod:`sparsecc.pruning.allocation`).

Scope under Wanda: ``"layer"`` (the default, as the paper) keeps the same fraction in every
output row of a layer for ``unstructured``; ``"erk"`` does the same at each layer's ERK
density; ``"global"`` ranks ``|W_ij| * ||X_j||`` (the size of each weight's contribution to
its output) across all layers with one threshold.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from .allocation import layer_patterns
from .masks import pattern_masks
from .patterns import Pattern, UnstructuredPattern
from .wanda import row_masks

WANDA = "wanda"
#: the criteria named by a string
CRITERIA = ("magnitude", WANDA)


def criterion_name(criterion) -> str:
    """The name a report gives a criterion: its string, or a callable's ``__name__``."""
    if isinstance(criterion, str):
        return criterion
    return getattr(criterion, "__name__", type(criterion).__name__)


def criterion_masks(pattern: Pattern, prunable: list[tuple[str, nn.Module, torch.Tensor]],
                    score_of: "Callable[[str, nn.Module], torch.Tensor] | None", scope: str, *,
                    rows: bool) -> Iterator[torch.Tensor]:
    """The masks of ``prunable`` ((name, module, [out, in] weight) triples), in order.

    ``score_of`` gives a layer's scores in [out, in] (None: magnitude). ``rows``: choose
    unstructured masks row by row (Wanda) rather than over the whole layer. One layer's
    scores are in memory at a time, except under ``scope="global"``.
    """
    magnitude = score_of is None

    def scores(name, module, matrix):
        return matrix if magnitude else score_of(name, module)

    if scope == "global":
        yield from pattern_masks(pattern, [scores(*layer) for layer in prunable],
                                 magnitude=magnitude, scope="global")
        return
    patterns = layer_patterns(pattern, [tuple(matrix.shape) for _, _, matrix in prunable], scope)
    for layer, layer_pattern in zip(prunable, patterns):
        layer_scores = scores(*layer)
        if rows and isinstance(layer_pattern, UnstructuredPattern):
            yield row_masks(layer_scores.abs() if magnitude else layer_scores, layer_pattern.density)
        else:
            yield pattern_masks(layer_pattern, [layer_scores], magnitude=magnitude)[0]
