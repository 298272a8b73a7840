"""Masks: pure functions from a weight to the boolean mask a pruning pattern keeps.

Every function takes 2-D tensors in the canonical orientation ``[N, K]`` (out features, in
features; groups run along K) and returns bool tensors of the same shapes, True where a
weight is kept. Nothing is modified.

Scores. Higher = keep. With ``magnitude=True`` (the default) a weight scores |w|; with
``magnitude=False`` the input already holds scores (a custom criterion). Vector-wise,
block-wise and block patterns score a unit by the sum of its scores, i.e. its L1 norm under
magnitude. Scores are compared in float32 (float64 for float64 input), which is exact for
every float16/bfloat16/float32 value.

Ties. Among equal scores the lower index wins: the earlier position along K inside a group;
the earlier unit in row-major order for ``block``/``unstructured``; the earlier weight in the
list given (for sparsecc.prune: model order) when one threshold covers several weights.

Rounding. A density pattern keeps ``kept_count(density, units)`` units:
``floor(density * units + 0.5)`` (round half up), at least 1 and at most ``units``.

Cost. Every mask is O(numel); nothing enumerates subsets or permutations. N:M masks walk
the weight in row chunks of about ``CHUNK_ELEMENTS`` (the working set stays in cache) and
select each chunk's groups with :class:`sparsecc.pruning.topn.TopN`; density patterns pick
their threshold with one ``kthvalue`` (a selection, not a sort).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from ..errors import InputError
from ..ir.formats import group_along_k
from .patterns import (BlockNMPattern, BlockPattern, NMPattern, Pattern, UnstructuredPattern,
                       VectorNMPattern, parse_pattern)
from .topn import TopN, check_no_nan

#: rows of an N:M mask are processed in chunks of about this many elements (4 MiB in fp32)
CHUNK_ELEMENTS = 1 << 20
#: what ``scope`` may be: each weight on its own, or one threshold across all of them
SCOPES = ("layer", "global")


def kept_count(density: float, units: int) -> int:
    """How many of ``units`` a density pattern keeps: round half up, at least 1 (if any)."""
    return min(units, max(1, math.floor(density * units + 0.5))) if units else 0


@torch.no_grad()
def nm_mask(weight: torch.Tensor, n: int, m: int, *, magnitude: bool = True) -> torch.Tensor:
    """Keep the n highest-scoring of every m consecutive weights along K.

    A K that is not a multiple of m is zero-padded like :func:`sparsecc.formats.group_along_k`;
    padding positions score below every real weight, so the last group keeps
    min(n, K mod m) real weights.
    """
    NMPattern(n, m)  # validates n and m
    weight = _check_matrix(weight)
    rows, cols = weight.shape
    mask = torch.empty(rows, cols, dtype=torch.bool, device=weight.device)  # fully written below
    if mask.numel() == 0:
        return mask
    groups_per_row = -(-cols // m)
    chunk_rows = max(1, CHUNK_ELEMENTS // (groups_per_row * m))
    dtype = _score_dtype(weight)
    select = TopN(n, m, chunk_rows * groups_per_row, dtype, weight.device)
    buffer = torch.empty(chunk_rows, cols, dtype=dtype, device=weight.device) if magnitude else None
    for start in range(0, rows, chunk_rows):
        chunk = weight[start:start + chunk_rows]
        scores = _scores(chunk, magnitude, out=None if buffer is None else buffer[: chunk.shape[0]])
        chunk_mask = mask[start:start + chunk_rows]
        if cols % m == 0:
            select(scores.reshape(-1, m), out=chunk_mask.view(-1, m))
            continue
        groups = group_along_k(scores, m)                    # [rows, G, m], zero-padded
        groups[:, -1, cols % m:] = -math.inf                 # padding never beats a weight
        chunk_mask.copy_(select(groups.view(-1, m)).view(groups.shape[0], -1)[:, :cols])
    return mask


@torch.no_grad()
def vector_nm_mask(weight: torch.Tensor, n: int, m: int, v: int, *,
                   magnitude: bool = True) -> torch.Tensor:
    """Vector-wise N:M: v consecutive rows share the n positions kept in each group of m.

    A position is scored by the sum of its scores over the v rows; a last partial vector
    (N mod v rows) is scored over its own rows.
    """
    VectorNMPattern(n, m, v)
    weight = _check_matrix(weight)
    vector_scores = _unit_scores(_scores(weight, magnitude), v, 1)        # [ceil(N/v), K]
    return _expand_units(nm_mask(vector_scores, n, m, magnitude=False), v, 1, weight.shape)


@torch.no_grad()
def block_nm_mask(weight: torch.Tensor, n: int, m: int, b: int, *,
                  magnitude: bool = True) -> torch.Tensor:
    """Block-wise N:M: in each strip of b rows, keep the n of every m consecutive b x b blocks
    along K with the largest summed score (L1 norm). N and K must be multiples of b."""
    pattern = BlockNMPattern(n, m, b)
    weight = _check_matrix(weight)
    pattern.check_shape(tuple(weight.shape))
    block_scores = _unit_scores(_scores(weight, magnitude), b, b)         # [N/b, K/b]
    return _expand_units(nm_mask(block_scores, n, m, magnitude=False), b, b, weight.shape)


@torch.no_grad()
def block_masks(weights: Sequence[torch.Tensor], h: int, w: int, density: float, *,
                magnitude: bool = True) -> list[torch.Tensor]:
    """Keep ``kept_count(density, all blocks)`` h x w blocks of largest summed score (L1 norm),
    chosen jointly over all ``weights`` (one threshold). Pass one weight for a per-layer mask."""
    pattern = BlockPattern(h, w, density)
    weights = [_check_matrix(weight) for weight in weights]
    for weight in weights:
        pattern.check_shape(tuple(weight.shape))
    block_scores = [_unit_scores(_scores(weight, magnitude), h, w) for weight in weights]
    block_keeps = _keep_top_fraction(block_scores, density)
    return [_expand_units(keep, h, w, weight.shape) for keep, weight in zip(block_keeps, weights)]


@torch.no_grad()
def unstructured_masks(weights: Sequence[torch.Tensor], density: float, *,
                       magnitude: bool = True) -> list[torch.Tensor]:
    """Keep ``kept_count(density, all weights)`` highest-scoring single weights, chosen jointly
    over all ``weights`` (one threshold). Pass one weight for a per-layer mask."""
    UnstructuredPattern(density)
    return _keep_top_fraction([_scores(_check_matrix(weight), magnitude) for weight in weights],
                              density)


@functools.singledispatch
def pattern_masks(pattern: Pattern, weights: Sequence[torch.Tensor], *,
                  magnitude: bool = True, scope: str = "layer") -> list[torch.Tensor]:
    """The masks ``pattern`` keeps for ``weights``.

    ``scope="layer"`` prunes each weight on its own; ``scope="global"`` applies one
    threshold across all of them, which only density patterns (``block``, ``unstructured``)
    support.
    """
    raise InputError(f"no mask function for pattern {pattern!r}")


@pattern_masks.register
def _(pattern: NMPattern, weights, *, magnitude=True, scope="layer"):
    check_scope(pattern, scope)
    return [nm_mask(weight, pattern.n, pattern.m, magnitude=magnitude) for weight in weights]


@pattern_masks.register
def _(pattern: VectorNMPattern, weights, *, magnitude=True, scope="layer"):
    check_scope(pattern, scope)
    return [vector_nm_mask(weight, pattern.n, pattern.m, pattern.v, magnitude=magnitude)
            for weight in weights]


@pattern_masks.register
def _(pattern: BlockNMPattern, weights, *, magnitude=True, scope="layer"):
    check_scope(pattern, scope)
    return [block_nm_mask(weight, pattern.n, pattern.m, pattern.b, magnitude=magnitude)
            for weight in weights]


@pattern_masks.register
def _(pattern: BlockPattern, weights, *, magnitude=True, scope="layer"):
    def masks(group):
        return block_masks(group, pattern.h, pattern.w, pattern.density, magnitude=magnitude)
    return _by_scope(pattern, scope, weights, masks)


@pattern_masks.register
def _(pattern: UnstructuredPattern, weights, *, magnitude=True, scope="layer"):
    def masks(group):
        return unstructured_masks(group, pattern.density, magnitude=magnitude)
    return _by_scope(pattern, scope, weights, masks)


def pattern_mask(pattern: "Pattern | str", weight: torch.Tensor, *,
                 magnitude: bool = True) -> torch.Tensor:
    """The mask ``pattern`` keeps for one weight (a pattern object or string)."""
    return pattern_masks(parse_pattern(pattern), [weight], magnitude=magnitude)[0]


def _keep_top_fraction(scores: Sequence[torch.Tensor], density: float) -> list[torch.Tensor]:
    """Bool masks keeping the ``kept_count(density, total)`` highest scores over all
    ``scores`` together, by one O(total) selection (kthvalue, no sort); ties go to the lower
    index in the concatenation order."""
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in scores), torch.float32)
    flat = torch.cat([s.reshape(-1).to(dtype) for s in scores])
    keep = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    kept = kept_count(density, flat.numel())
    if kept:
        check_no_nan(flat)
        threshold = flat.kthvalue(flat.numel() - kept + 1).values
        torch.gt(flat, threshold, out=keep)
        missing = kept - int(keep.sum())
        keep[(flat == threshold).nonzero().squeeze(1)[:missing]] = True
    return [part.view(s.shape) for part, s in zip(keep.split([s.numel() for s in scores]), scores)]


def _unit_scores(scores: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Summed scores of the h x w units of ``scores`` ([N, K] -> [ceil(N/h), ceil(K/w)]);
    a partial unit at the bottom or right edge sums only the scores it covers."""
    rows, cols = scores.shape
    scores = torch.nn.functional.pad(scores, (0, (-cols) % w, 0, (-rows) % h))
    return scores.reshape(scores.shape[0] // h, h, scores.shape[1] // w, w).sum((1, 3))


def _expand_units(unit_keep: torch.Tensor, h: int, w: int, shape) -> torch.Tensor:
    """Spread a per-unit mask back over the weights (the inverse layout of _unit_scores)."""
    unit_rows, unit_cols = unit_keep.shape
    full = unit_keep[:, None, :, None].expand(unit_rows, h, unit_cols, w)
    return full.reshape(unit_rows * h, unit_cols * w)[: shape[0], : shape[1]].contiguous()


def _score_dtype(values: torch.Tensor) -> torch.dtype:
    """float32 holds every float16/bfloat16/float32 value exactly; float64 the rest."""
    return torch.float32 if values.is_floating_point() and values.dtype != torch.float64 else torch.float64


def _scores(values: torch.Tensor, magnitude: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The scores of ``values`` (|values|, or the values themselves) as float32 or float64,
    for exact comparisons; written into ``out`` if given (magnitude only)."""
    if not values.is_floating_point():
        values = values.double()
    if not magnitude:
        return values.to(_score_dtype(values))
    if out is None:
        return values.abs().to(_score_dtype(values))
    if values.dtype == out.dtype:
        return torch.abs(values, out=out)
    return out.copy_(values).abs_()


def _check_matrix(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InputError("a weight to prune must be a 2-D tensor [out features, in features]; "
                         f"got {type(weight).__name__}{tuple(getattr(weight, 'shape', ()))}")
    return weight.detach()


def check_scope(pattern: Pattern, scope: str) -> None:
    """Raise InputError unless ``scope`` is one of SCOPES and means something for ``pattern``."""
    if scope not in SCOPES:
        raise InputError(f"scope must be 'layer' or 'global', got {scope!r}")
    if scope == "global" and not pattern.SUPPORTS_GLOBAL_SCOPE:
        raise InputError(f"scope='global' is for density patterns ('unstructured@<d>', "
                         f"'block<h>x<w>@<d>'); {pattern} is chosen group by group, so use "
                         "scope='layer'")


def _by_scope(pattern: Pattern, scope: str, weights, masks_of) -> list[torch.Tensor]:
    """One joint call for scope='global', one call per weight for scope='layer'."""
    check_scope(pattern, scope)
    if scope == "global":
        return masks_of(list(weights))
    return [masks_of([weight])[0] for weight in weights]
