"""The work of one linear product on one implementation: what the cost model prices.

An implementation is whatever runs a format on a device: one of torch's paths
(:mod:`sparsecc.planner.work`) or one of sparsecc's kernel families
(:mod:`sparsecc.kernels`), each of which says how many flops, bytes and dependent pipeline
steps a :class:`Workload` costs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    """One product ``[m, k] x [k, n]`` on one implementation, with what its cost depends on."""

    impl: str
    dtype: str
    m: int
    n: int
    k: int
    density: float = 1.0                       # non-zeros / elements of the weight
    block: tuple[int, int] | None = None       # BSR block (rows, cols)
    block_density: float | None = None         # stored blocks / all blocks
    tile: tuple[int, int] | None = None        # (rows of W, rows of x) per CTA of a sparsecc kernel
    mode: int | None = None                    # a kernel's mode where it has several (its family says)

    @property
    def element_size(self) -> int:
        return element_size(self.dtype)

    @property
    def stored_density(self) -> float:
        """The share of the weight a block format stores: its block density where known."""
        return self.block_density if self.block_density is not None else self.density

    def activation_bytes(self) -> tuple[float, float]:
        """``(x bytes, y bytes)``: x read once, y written once."""
        e = self.element_size
        return float(self.m * self.k * e), float(self.m * self.n * e)


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``str(torch.float16)`` without ``torch.``."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float16"`` for ``torch.float16`` (a name passes through)."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
