"""The n highest scores in every group of m: the selection behind every N:M mask, in O(G*m).

apex ASP picks 2:4 masks by enumerating candidate patterns (O(m!)), which is why it stops
at small m. Here a group's n-th highest score is found with elementwise max/min ops only,
and the kept set is ``score >= that threshold``; no sort, no per-group loop, no subsets.

Exactness. The threshold set is exactly the top n whenever a group holds exactly n scores
at or above it, which one count over the chunk confirms. Groups with ties at the threshold
(equal magnitudes do occur in real weights) are redone with a stable sort, which applies
the tie rule: among equal scores, the lower index wins.

Speed. On a CPU, elementwise torch ops on large tensors are cheap only when (1) they run
over long contiguous runs (torch is slow on runs of 1 to 4 elements, e.g. a reduction over
a last dimension of 4) and (2) their outputs land in memory already mapped (a fresh
multi-megabyte tensor costs a page fault per 4 KiB). So :class:`TopN` keeps its buffers
for all the chunks of a weight and writes every op into them (``out=``), and its
tournament only combines long contiguous runs (see :meth:`TopN._order_statistic`).
"""
from __future__ import annotations

import math

import torch

from ..errors import InputError

#: the highest rank found by the max/min tournament (op count ~ rank**2); above, torch.topk
TOURNAMENT_MAX_RANK = 4
#: the tournament merges row halves while rows are wider than this, then shifted flat views
TOURNAMENT_SHIFT_WIDTH = 4
#: groups up to this size are compared column by column, larger ones in one broadcast
COLUMN_COMPARE_MAX_M = 8


class TopN:
    """Selects the n highest scores of every row of [G, m] chunks (G <= ``max_groups``),
    reusing its buffers from one chunk to the next. One TopN serves one weight."""

    def __init__(self, n: int, m: int, max_groups: int, dtype: torch.dtype, device=None):
        self.n, self.m = n, m
        # Compare against the n-th highest score (>=) or, when n > m/2, against the (m-n)-th
        # lowest (>): whichever rank is lower, since the cost grows with the rank.
        self.largest = n <= m - n
        self.rank = n if self.largest else m - n
        self.compare = torch.ge if self.largest else torch.gt
        self.better, self.worse = ((torch.maximum, torch.minimum) if self.largest
                                   else (torch.minimum, torch.maximum))
        self.width = 1 << (m - 1).bit_length()          # m rounded up to a power of two
        self.use_tournament = self.rank <= TOURNAMENT_MAX_RANK
        if not self.use_tournament:
            return
        capacity = max_groups * self.width
        buffers = lambda: [torch.empty(capacity, dtype=dtype, device=device)  # noqa: E731
                           for _ in range(self.rank)]
        self._lists = (buffers(), buffers())             # read one, write the other; swap
        self._scratch = torch.empty(capacity, dtype=dtype, device=device)
        self._padded = None
        if self.width != m:                              # pad with scores that never win
            self._padded = torch.full((max_groups, self.width), -math.inf if self.largest else math.inf,
                                      dtype=dtype, device=device)

    def __call__(self, groups: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bool mask of the n highest scores of each row of ``groups``, exactly n per row,
        the lower index first among equal scores; written into ``out`` if given."""
        keep = torch.empty(groups.shape, dtype=torch.bool, device=groups.device) if out is None else out
        threshold = self._order_statistic(groups)
        if self.m <= COLUMN_COMPARE_MAX_M:   # m strided compares beat one broadcast on short rows
            for column, kept in zip(groups.unbind(-1), keep.unbind(-1)):
                self.compare(column, threshold, out=kept)
        else:
            self.compare(groups, threshold.unsqueeze(-1), out=keep)
        if int(torch.count_nonzero(keep)) != self.n * groups.shape[0]:
            _redo_tied_groups(groups, keep, self.n)
        return keep

    def _order_statistic(self, groups: torch.Tensor) -> torch.Tensor:
        """The rank-th best score of each row of ``groups`` ([G]), duplicates counted.

        A tournament: two sets of positions are combined by merging their lists of the best
        ``rank`` scores (:meth:`_merge`), log2(m) times until a list covers a whole row.
        While rows are wide, a round merges the left half of every row with its right half
        (runs of m/2 contiguous scores). Once they are narrow, each list is flattened and
        position i is merged with position i + d, for d = 1, 2, 4, ...: whole contiguous
        tensors, twice the useful work but vectorised; a row's result ends at its first
        position.
        """
        if not self.use_tournament:
            best = groups.topk(self.rank, dim=-1, largest=self.largest, sorted=False).values
            return (best.amin if self.largest else best.amax)(dim=-1)
        if self._padded is not None:
            padded = self._padded[: groups.shape[0]]
            padded[:, : self.m] = groups
            groups = padded
        best, spare = [groups], 0
        width = self.width
        while width > TOURNAMENT_SHIFT_WIDTH:
            width //= 2
            best = self._merge([t[:, :width] for t in best], [t[:, width:] for t in best],
                               self._lists[spare])
            spare = 1 - spare
        best = [t.reshape(-1) for t in best]
        for distance in (1 << level for level in range(width.bit_length() - 1)):
            best = self._merge([t[:-distance] for t in best], [t[distance:] for t in best],
                               self._lists[spare])
            spare = 1 - spare
        return best[self.rank - 1][::width]

    def _merge(self, a: list, b: list, buffers: list) -> list:
        """The best ``rank`` of two best-first lists of equal-shaped tensors, elementwise,
        written into ``buffers``.

        The k-th best of the union is the best of a[k], b[k] and worse(a[i], b[k-i]) for
        0 < i < k (1-based): some i of the k best come from ``a`` and k-i from ``b``.
        """
        shape, size = a[0].shape, a[0].numel()
        scratch = self._scratch[:size].view(shape)
        merged = []
        for k in range(1, min(self.rank, len(a) + len(b)) + 1):
            best = buffers[k - 1][:size].view(shape)
            pairs = [(a[i - 1], b[k - i - 1]) for i in range(1, k) if i <= len(a) and k - i <= len(b)]
            if k <= len(a):                   # a and b always have the same length
                self.better(a[k - 1], b[k - 1], out=best)
            else:
                self.worse(*pairs.pop(), out=best)
            for x, y in pairs:
                self.better(best, self.worse(x, y, out=scratch), out=best)
            merged.append(best)
        return merged


def _redo_tied_groups(groups: torch.Tensor, keep: torch.Tensor, n: int) -> None:
    """Recompute, in place, the rows of ``keep`` that do not hold exactly n: a stable
    descending sort keeps the lower index first among equal scores."""
    wrong = (keep.sum(-1) != n).nonzero().squeeze(1)
    scores = groups[wrong]
    check_no_nan(scores)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    keep[wrong] = torch.zeros(scores.shape, dtype=torch.bool, device=keep.device).scatter_(-1, order, True)


def check_no_nan(scores: torch.Tensor) -> None:
    """Raise InputError if any score is NaN (no order, so no mask, exists)."""
    if torch.isnan(scores).any():
        raise InputError("cannot prune: a score is NaN (a NaN weight, or a criterion that "
                         "returned NaN); fix the weights or the criterion first")
