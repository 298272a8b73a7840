"""Masks: pure functions from a weight to the boolean mask a pruning pattern keeps.

Every function takes 2-D tensors in the canonical orientation ``[N, K]`` (out features, in
features; groups run along K) and returns bool tensors of the same shapes, True where a
weight is kept. Nothing is modified.

Scores. ``key`` maps (a chunk of) the input to scores, higher = keep: ``torch.abs`` by
default (magnitude pruning), ``None`` when the input already holds scores (a custom
criterion). Vector-wise, block-wise and block patterns score a unit by the sum of its
scores, i.e. its L1 norm under magnitude. Scores are compared in float32 (float64 for
float64 input), which is exact for every float16/bfloat16/float32 value.

Ties. Among equal scores the lower index wins: the earlier position along K inside a group;
the earlier unit in row-major order for ``block``/``unstructured``; the earlier weight in the
list given (for sparsecc.prune: model order) when one threshold covers several weights.

Rounding. A density pattern keeps ``kept_count(density, units)`` units:
``floor(density * units + 0.5)`` (round half up), at least 1 and at most ``units``.

Cost. Every mask is O(numel); nothing enumerates subsets or permutations (apex ASP does,
which is why it stops at 2:4). N:M masks walk the weight in row chunks of about
``CHUNK_ELEMENTS`` so the working set stays in cache. Per chunk the n-th largest score of
every group is found with elementwise max/min ops only (an insertion network over the m
columns for small m, repeated max-and-remove over each group for larger m); the kept set
is ``score >= threshold``. That set is exactly the top n whenever a group holds exactly n
such scores, which one sum over the chunk confirms; the rare groups with ties at the
threshold are redone with a stable sort, which applies the tie rule.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch

from ..errors import InputError
from ..formats import group_along_k
from .patterns import (BlockNMPattern, BlockPattern, NMPattern, Pattern, UnstructuredPattern,
                       VectorNMPattern, parse_pattern)

Key = Callable[[torch.Tensor], torch.Tensor]

#: rows of an N:M mask are processed in chunks of about this many elements (4 MiB in fp32)
CHUNK_ELEMENTS = 1 << 20
#: what ``scope`` may be: each weight on its own, or one threshold across all of them
SCOPES = ("layer", "global")
#: groups of at most this many elements use the column network, larger ones max-and-remove
SMALL_GROUP = 8


def kept_count(density: float, units: int) -> int:
    """How many of ``units`` a density pattern keeps: round half up, at least 1 (if any)."""
    return min(units, max(1, math.floor(density * units + 0.5))) if units else 0


@torch.no_grad()
def nm_mask(weight: torch.Tensor, n: int, m: int, *, key: Key | None = torch.abs) -> torch.Tensor:
    """Keep the n highest-scoring of every m consecutive weights along K.

    A K that is not a multiple of m is zero-padded like :func:`sparsecc.formats.group_along_k`;
    padding positions score below every real weight, so the last group keeps
    min(n, K mod m) real weights.
    """
    NMPattern(n, m)  # validates n and m
    weight = _check_matrix(weight)
    rows, cols = weight.shape
    mask = torch.zeros(rows, cols, dtype=torch.bool, device=weight.device)
    if mask.numel() == 0:
        return mask
    chunk_rows = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, chunk_rows):
        scores = _scores(weight[start:start + chunk_rows], key)
        groups = group_along_k(scores, m)                    # [rows, G, m], zero-padded
        if cols % m:
            groups[:, -1, cols % m:] = -math.inf             # padding never beats a weight
        keep = keep_top_n(groups.reshape(-1, m), n)
        mask[start:start + chunk_rows] = keep.view(groups.shape[0], -1)[:, :cols]
    return mask


@torch.no_grad()
def vector_nm_mask(weight: torch.Tensor, n: int, m: int, v: int, *,
                   key: Key | None = torch.abs) -> torch.Tensor:
    """Vector-wise N:M: v consecutive rows share the n positions kept in each group of m.

    A position is scored by the sum of its scores over the v rows; a last partial vector
    (N mod v rows) is scored over its own rows.
    """
    VectorNMPattern(n, m, v)
    weight = _check_matrix(weight)
    vector_scores = _unit_scores(_scores(weight, key), v, 1)             # [ceil(N/v), K]
    return _expand_units(nm_mask(vector_scores, n, m, key=None), v, 1, weight.shape)


@torch.no_grad()
def block_nm_mask(weight: torch.Tensor, n: int, m: int, b: int, *,
                  key: Key | None = torch.abs) -> torch.Tensor:
    """Block-wise N:M: in each strip of b rows, keep the n of every m consecutive b x b blocks
    along K with the largest summed score (L1 norm). N and K must be multiples of b."""
    pattern = BlockNMPattern(n, m, b)
    weight = _check_matrix(weight)
    pattern.check_shape(tuple(weight.shape))
    block_scores = _unit_scores(_scores(weight, key), b, b)              # [N/b, K/b]
    return _expand_units(nm_mask(block_scores, n, m, key=None), b, b, weight.shape)


@torch.no_grad()
def block_masks(weights: Sequence[torch.Tensor], h: int, w: int, density: float, *,
                key: Key | None = torch.abs) -> list[torch.Tensor]:
    """Keep ``kept_count(density, all blocks)`` h x w blocks of largest summed score (L1 norm),
    chosen jointly over all ``weights`` (one threshold). Pass one weight for a per-layer mask."""
    pattern = BlockPattern(h, w, density)
    weights = [_check_matrix(weight) for weight in weights]
    for weight in weights:
        pattern.check_shape(tuple(weight.shape))
    block_keeps = _keep_top_fraction([_unit_scores(_scores(weight, key), h, w) for weight in weights],
                                     density)
    return [_expand_units(keep, h, w, weight.shape) for keep, weight in zip(block_keeps, weights)]


@torch.no_grad()
def unstructured_masks(weights: Sequence[torch.Tensor], density: float, *,
                       key: Key | None = torch.abs) -> list[torch.Tensor]:
    """Keep ``kept_count(density, all weights)`` highest-scoring single weights, chosen jointly
    over all ``weights`` (one threshold). Pass one weight for a per-layer mask."""
    UnstructuredPattern(density)
    return _keep_top_fraction([_scores(_check_matrix(weight), key) for weight in weights], density)


@functools.singledispatch
def pattern_masks(pattern: Pattern, weights: Sequence[torch.Tensor], *,
                  key: Key | None = torch.abs, scope: str = "layer") -> list[torch.Tensor]:
    """The masks ``pattern`` keeps for ``weights``.

    ``scope="layer"`` prunes each weight on its own; ``scope="global"`` applies one
    threshold across all of them, which only density patterns (``block``, ``unstructured``)
    support.
    """
    raise InputError(f"no mask function for pattern {pattern!r}")


@pattern_masks.register
def _(pattern: NMPattern, weights, *, key=torch.abs, scope="layer"):
    _check_scope(pattern, scope)
    return [nm_mask(weight, pattern.n, pattern.m, key=key) for weight in weights]


@pattern_masks.register
def _(pattern: VectorNMPattern, weights, *, key=torch.abs, scope="layer"):
    _check_scope(pattern, scope)
    return [vector_nm_mask(weight, pattern.n, pattern.m, pattern.v, key=key) for weight in weights]


@pattern_masks.register
def _(pattern: BlockNMPattern, weights, *, key=torch.abs, scope="layer"):
    _check_scope(pattern, scope)
    return [block_nm_mask(weight, pattern.n, pattern.m, pattern.b, key=key) for weight in weights]


@pattern_masks.register
def _(pattern: BlockPattern, weights, *, key=torch.abs, scope="layer"):
    def masks(group):
        return block_masks(group, pattern.h, pattern.w, pattern.density, key=key)
    return _by_scope(pattern, scope, weights, masks)


@pattern_masks.register
def _(pattern: UnstructuredPattern, weights, *, key=torch.abs, scope="layer"):
    def masks(group):
        return unstructured_masks(group, pattern.density, key=key)
    return _by_scope(pattern, scope, weights, masks)


def pattern_mask(pattern: "Pattern | str", weight: torch.Tensor, *,
                 key: Key | None = torch.abs) -> torch.Tensor:
    """The mask ``pattern`` keeps for one weight (a pattern object or string)."""
    return pattern_masks(parse_pattern(pattern), [weight], key=key)[0]


def keep_top_n(groups: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the n highest scores in each row of ``groups`` ([G, m]), lower index first
    among equal scores. Exactly n per row, in O(G*m)."""
    m = groups.shape[-1]
    largest = n <= m - n
    # Find the n-th largest score (compare >=), or, when n > m/2, the (m-n)-th smallest
    # (compare >): whichever takes fewer steps.
    rank = n if largest else m - n
    compare = torch.ge if largest else torch.gt
    if m <= SMALL_GROUP:
        threshold = _threshold_by_columns(groups, rank, largest)
        keep = torch.empty(groups.shape, dtype=torch.bool, device=groups.device)
        for column, kept in zip(groups.unbind(-1), keep.unbind(-1)):
            compare(column, threshold, out=kept)
    else:
        keep = compare(groups, _threshold_by_rounds(groups, rank, largest))
    if int(keep.sum()) != n * groups.shape[0]:
        _redo_tied_groups(groups, keep, n)
    return keep


def _threshold_by_columns(groups: torch.Tensor, rank: int, largest: bool) -> torch.Tensor:
    """The rank-th largest (or smallest) score of each group ([G]), by an insertion network
    over the m columns: about 2*m*rank elementwise ops on G-long columns, cheapest for
    small m (a reduction over a last dimension of 4 is slow in torch)."""
    better, worse = (torch.maximum, torch.minimum) if largest else (torch.minimum, torch.maximum)
    best: list[torch.Tensor] = []        # best[i]: the (i+1)-th best score seen so far
    for column in groups.unbind(-1):
        carry = column
        for i, held in enumerate(best):
            best[i] = better(held, carry)
            if i + 1 < len(best) or len(best) < rank:      # the displaced score moves down
                carry = worse(held, carry)
        if len(best) < rank:
            best.append(carry)
    return best[-1]


def _threshold_by_rounds(groups: torch.Tensor, rank: int, largest: bool) -> torch.Tensor:
    """The rank-th distinct largest (or smallest) score of each group ([G, 1]), by taking the
    extreme of every group rank times and removing it. Duplicates go together, so a tie
    makes more than n scores reach the threshold, which keep_top_n's count check catches."""
    extreme, removed = (torch.amax, -math.inf) if largest else (torch.amin, math.inf)
    work = groups.clone() if rank > 1 else groups
    for step in range(rank):
        value = extreme(work, dim=-1, keepdim=True)
        if step + 1 < rank:
            work.masked_fill_(work == value, removed)
    return value


def _redo_tied_groups(groups: torch.Tensor, keep: torch.Tensor, n: int) -> None:
    """Recompute, in place, the rows of ``keep`` that do not hold exactly n: a stable
    descending sort keeps the lower index first among equal scores."""
    wrong = (keep.sum(-1) != n).nonzero().squeeze(1)
    scores = groups[wrong]
    _check_no_nan(scores)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    keep[wrong] = torch.zeros(scores.shape, dtype=torch.bool, device=keep.device).scatter_(-1, order, True)


def _keep_top_fraction(scores: Sequence[torch.Tensor], density: float) -> list[torch.Tensor]:
    """Bool masks keeping the ``kept_count(density, total)`` highest scores over all
    ``scores`` together, by one O(total) selection (kthvalue, no sort); ties go to the lower
    index in the concatenation order."""
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in scores), torch.float32)
    flat = torch.cat([s.reshape(-1).to(dtype) for s in scores])
    keep = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    kept = kept_count(density, flat.numel())
    if kept:
        _check_no_nan(flat)
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


def _scores(values: torch.Tensor, key: Key | None) -> torch.Tensor:
    """``key(values)`` (or ``values`` itself), as float32 or float64 for exact comparisons."""
    scores = values if key is None else key(values)
    if not isinstance(scores, torch.Tensor) or scores.shape != values.shape:
        raise InputError(f"scores must be a tensor of the weight's shape {tuple(values.shape)}, got "
                         f"{type(scores).__name__}{tuple(getattr(scores, 'shape', ()))}")
    return scores.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)


def _check_matrix(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InputError("a weight to prune must be a 2-D tensor [out features, in features]; "
                         f"got {type(weight).__name__}{tuple(getattr(weight, 'shape', ()))}")
    return weight.detach()


def _check_no_nan(scores: torch.Tensor) -> None:
    if torch.isnan(scores).any():
        raise InputError("cannot prune: a score is NaN (a NaN weight, or a criterion that "
                         "returned NaN); fix the weights or the criterion first")


def _check_scope(pattern: Pattern, scope: str) -> None:
    if scope not in SCOPES:
        raise InputError(f"scope must be 'layer' or 'global', got {scope!r}")
    if scope == "global" and not pattern.SUPPORTS_GLOBAL_SCOPE:
        raise InputError(f"scope='global' is for density patterns ('unstructured@<d>', "
                         f"'block<h>x<w>@<d>'); {pattern} is chosen group by group, so use "
                         "scope='layer'")


def _by_scope(pattern: Pattern, scope: str, weights, masks_of) -> list[torch.Tensor]:
    """One joint call for scope='global', one call per weight for scope='layer'."""
    _check_scope(pattern, scope)
    if scope == "global":
        return masks_of(list(weights))
    return [masks_of([weight])[0] for weight in weights]
