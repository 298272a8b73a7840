"""How a density pattern's budget is spread over layers: ``scope="erk"``.

``scope="layer"`` gives every layer the pattern's density; ``scope="global"`` ranks all
weights together, which at high sparsity can empty a layer whose weights are small by
initialisation scale (on the digits MLP, 98% global leaves the 256->128 layer at 0.02%
density and accuracy collapses). ``scope="erk"`` (Erdős–Rényi-Kernel, as in RigL, Evci et
al. 2020) gives a layer of shape [out, in] a density proportional to (out + in) / (out * in),
scaled so that the selected layers together keep the pattern's density: small layers (the
output layer) keep more, wide ones less, and none is emptied. A layer whose share would
exceed 1 stays dense and the others are rescaled.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..errors import InputError
from .masks import SCOPES, check_scope
from .patterns import Pattern

#: scopes that give each layer its own density (on top of masks.SCOPES)
ALLOCATIONS = ("erk",)


def check_prune_scope(pattern: Pattern, scope: str) -> None:
    """Raise InputError unless ``scope`` is ``"layer"``, ``"global"`` or ``"erk"`` and fits
    ``pattern`` (the last two need a density pattern)."""
    if scope in ALLOCATIONS:
        if not pattern.SUPPORTS_GLOBAL_SCOPE:
            raise InputError(f"scope={scope!r} spreads a density over layers; {pattern} has no "
                             "density to spread: use 'unstructured@<d>' or 'block<h>x<w>@<d>', "
                             "or scope='layer'")
        return
    if scope not in SCOPES:
        raise InputError(f"scope must be 'layer', 'global' or 'erk', got {scope!r}")
    check_scope(pattern, scope)


def erk_densities(shapes: Sequence[tuple[int, int]], density: float) -> list[float]:
    """Per-layer densities for ``shapes`` ([out, in]) that keep ``density`` of all their
    weights together, each proportional to (out + in) / (out * in), capped at 1."""
    sizes = [rows * cols for rows, cols in shapes]
    raw = [(rows + cols) / (rows * cols) for rows, cols in shapes]
    dense: set[int] = set()
    while True:
        budget = density * sum(sizes) - sum(sizes[i] for i in dense)
        free = sum(raw[i] * sizes[i] for i in range(len(shapes)) if i not in dense)
        scale = budget / free if free else 0.0
        over = {i for i in range(len(shapes)) if i not in dense and scale * raw[i] >= 1.0}
        if not over:
            return [1.0 if i in dense else scale * raw[i] for i in range(len(shapes))]
        dense |= over


def layer_patterns(pattern: Pattern, shapes: Sequence[tuple[int, int]], scope: str) -> list[Pattern]:
    """The pattern each layer gets: ``pattern`` itself, or under ``scope="erk"`` a copy with
    that layer's density."""
    if scope not in ALLOCATIONS:
        return [pattern] * len(shapes)
    return [replace(pattern, density=min(1.0, max(d, 1e-12))) for d in erk_densities(shapes, pattern.density)]
