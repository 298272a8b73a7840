"""The guard that keeps NaN and Inf exact after the 2:4 GEMMs and the BSR kernels, cheaply.

Dense ``F.linear`` multiplies every input by every weight, so a NaN or an infinity of ``x``
makes NaN in every output whose weight is zero there (``0 * NaN = 0 * Inf = NaN``). The sparse
kernels skip the weights they do not store (pruned entries of 2:4 groups, absent blocks), so a
pass after the product stores the NaN dense would have made. Reading all of ``x`` for that
costs as much as a large-batch sparse product itself, so the pass reads it only when it must:

- a non-finite input that meets a *stored* weight (stored zeros included) makes that output's
  sum non-finite: the product's epilogue then raises the site's guard flag, and the pass tests
  every input;
- an input that no stored weight meets (a block column no block row stores, a column of a 2:4
  weight that is zero in every row) changes no sum: the guard lists those inputs, in groups of
  :data:`GROUP`, and the pass tests them on every call. :func:`cover_block_columns` stores a
  block of zeros in each such column instead, so that there is nothing to list (the default
  where the wgmma or the small-batch mma kernel runs the site).

With finite ``x`` the pass then reads only the listed groups and writes nothing. The guard is
a few int32 words kept after a site's metadata (templates/common.j2, ``guard_helpers``):
``[flag, finished CTAs, group count, group...]``; after a raised flag the pass's last CTA
lowers it for the next call. The small-batch mma BSR kernel launches no pass and leaves the flag
alone: its CTAs count themselves in the second word (a CTA with a sum that is not finite sets
that word's top bit first) and the last one runs the pass's rows itself. A site's guard belongs to its packed weight, so one
packed weight must not run on two CUDA streams at the same time (as with any buffer a kernel
writes).

The BSR kernels raise the flag from their own epilogue. The cooperative 2:4 GEMMs raise it from
a node of CUTLASS's epilogue visitor tree (``NonfiniteProbe`` in
templates/gemm_sm90_sparse24.cu.j2); the pingpong ones, whose epilogue the probe slowed, keep
a pass that reads all of ``x``. The 2:4 metadata is CUTLASS's, so the guard sits after it at
the next multiple of :data:`ALIGNMENT` bytes (:func:`append_guard`).
"""
from __future__ import annotations

import torch

from ..codegen.spec import GUARD_ALIGNMENT as ALIGNMENT
from ..codegen.spec import GUARD_GROUP as GROUP
from ..codegen.spec import GUARD_HEADER_WORDS as HEADER_WORDS
from ..errors import InputError

__all__ = ["ALIGNMENT", "GROUP", "HEADER_WORDS", "append_guard", "cover_block_columns", "groups_of", "guard_after",
           "guard_words"]


def guard_words(unmet: torch.Tensor) -> torch.Tensor:
    """The guard (int32, flag lowered) of a site whose product meets no stored weight at the
    inputs where ``unmet`` (bool, one per input) is True: the groups holding one are listed."""
    k = unmet.numel()
    if k % GROUP:
        raise InputError(f"the non-finite guard needs the inputs in groups of {GROUP} (this weight has {k})")
    groups = unmet.reshape(k // GROUP, GROUP).any(dim=1).nonzero().flatten().to(torch.int32)
    header = torch.tensor([0, 0, groups.numel()], dtype=torch.int32, device=unmet.device)
    return torch.cat([header, groups])


def _guard_start(metadata_bytes: int) -> int:
    """Where a 2:4 weight's guard starts: the first multiple of :data:`ALIGNMENT` bytes at or
    after the end of its metadata (the GEMM template's ``guard_of`` rounds the same way)."""
    return -(-metadata_bytes // ALIGNMENT) * ALIGNMENT


def append_guard(metadata: torch.Tensor, unmet: torch.Tensor) -> torch.Tensor:
    """``metadata`` (uint8, a 2:4 GEMM's, as CUTLASS's compressor wrote it) followed, at the next
    multiple of :data:`ALIGNMENT` bytes, by the guard of :func:`guard_words` for ``unmet``."""
    guard = guard_words(unmet)
    start = _guard_start(metadata.numel())
    packed = metadata.new_zeros(start + 4 * guard.numel())
    packed[:metadata.numel()] = metadata
    packed[start:].view(torch.int32).copy_(guard)
    return packed


def guard_after(metadata: torch.Tensor, metadata_bytes: int) -> torch.Tensor:
    """The guard words (int32 view) of a 2:4 GEMM's ``metadata`` made by :func:`append_guard`
    from ``metadata_bytes`` bytes of CUTLASS's metadata."""
    return metadata[_guard_start(metadata_bytes):].view(torch.int32)


def groups_of(guard: torch.Tensor) -> torch.Tensor:
    """The listed groups of a guard made by :func:`guard_words`."""
    return guard[HEADER_WORDS: HEADER_WORDS + int(guard[HEADER_WORDS - 1])]


def cover_block_columns(present: torch.Tensor) -> torch.Tensor:
    """``present`` ([R, C] bool, the stored blocks) with a block added in every block column
    that has none, each in the block row with the fewest blocks at that point (the first of
    equals): the kernel's sums then meet every input, and the block rows stay balanced."""
    present = present.clone()
    if present.shape[0] == 0:
        return present
    lengths = present.sum(dim=1)
    for column in (~present.any(dim=0)).nonzero().flatten().tolist():
        row = int(lengths.argmin())
        present[row, column] = True
        lengths[row] += 1
    return present
