"""Wanda (Sun et al., 2023): prune by weight magnitude times input-feature norm, row by row.

A weight W_ij contributes W_ij * x_j to output i. Its Wanda score, ``|W_ij| * ||X_j||_2``
(the norm over calibration tokens, :func:`sparsecc.pruning.calibration.input_norms`), is
how much that contribution weighs on real inputs; magnitude alone ignores that some input
features (the outlier features of large language models) are far larger than others.

The paper compares scores within each output row: every row keeps the same number of
weights, which is what :func:`row_masks` does for unstructured patterns. N:M patterns
already choose inside each row's groups; block and vector patterns sum the scores of a unit.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .calibration import input_norms
from .masks import kept_count
from .selection import weight_matrix
from .topn import check_no_nan


def wanda_scorer(model: nn.Module, layers: list[tuple[str, nn.Module]],
                 calibration) -> Callable[[str, nn.Module], torch.Tensor]:
    """Measure the layers' input norms on ``calibration`` (one pass, now) and return a
    function ``(name, module) -> scores`` in the canonical [out, in] orientation, computed
    when asked (one layer's scores in memory at a time)."""
    norms = input_norms(model, layers, calibration)

    def score_of(name: str, module: nn.Module) -> torch.Tensor:
        return wanda_scores(weight_matrix(module), norms[name])

    return score_of


@torch.no_grad()
def wanda_scores(matrix: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``|W_ij| * norms_j`` for a weight [out, in] and input norms [in], in float32 (float64
    when either is float64), on the weight's device."""
    dtype = torch.float64 if torch.float64 in (matrix.dtype, norms.dtype) else torch.float32
    return matrix.detach().abs().to(dtype) * norms.to(device=matrix.device, dtype=dtype)


@torch.no_grad()
def row_masks(scores: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``kept_count(density, in features)`` highest scores of every row; among equal
    scores the lower column wins. O(numel) per row (kthvalue), a stable sort only for rows
    with ties at the threshold."""
    rows, cols = scores.shape
    keep = torch.zeros(rows, cols, dtype=torch.bool, device=scores.device)
    kept = kept_count(density, cols)
    if not kept or not rows:
        return keep
    check_no_nan(scores)
    threshold = scores.kthvalue(cols - kept + 1, dim=1, keepdim=True).values
    torch.ge(scores, threshold, out=keep)
    tied = (keep.sum(1) != kept).nonzero().squeeze(1)
    if tied.numel():
        order = scores[tied].sort(dim=1, descending=True, stable=True).indices[:, :kept]
        keep[tied] = torch.zeros(len(tied), cols, dtype=torch.bool,
                                 device=scores.device).scatter_(1, order, True)
    return keep
