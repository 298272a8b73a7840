"""Random weights with a sparsity pattern: what launch tuning and calibration time kernels on."""
from __future__ import annotations

import re

import torch


def random_weight(n: int, k: int, pattern: str, density: float, dtype: torch.dtype, device,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A random ``[n, k]`` weight with a sparsity ``pattern``: ``dense``, ``n:m`` (e.g.
    ``2:4``: the largest n of every m kept), ``block<h>`` or ``block<h>x<w>`` (that fraction of
    blocks kept) or ``unstructured`` (that fraction of elements kept). Values are normal,
    never zero where kept."""
    def uniform(*shape):
        return torch.rand(*shape, generator=generator, device=generator.device if generator else device)

    values = torch.randn(n, k, generator=generator, device=generator.device if generator else device) * 0.05
    values = values + values.sign() * 1e-3              # no accidental zeros
    if pattern == "dense":
        mask = torch.ones_like(values, dtype=torch.bool)
    elif match := re.fullmatch(r"(\d+):(\d+)", pattern):
        keep, group = int(match[1]), int(match[2])
        grouped = values.abs().reshape(n, k // group, group)
        order = grouped.argsort(dim=-1, descending=True)
        mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, order[..., :keep], True).reshape(n, k)
    elif match := re.fullmatch(r"block(\d+)(?:x(\d+))?", pattern):
        h = int(match[1])
        w = int(match[2] or h)
        blocks = uniform(n // h, k // w) < density
        mask = blocks.repeat_interleave(h, 0).repeat_interleave(w, 1)
    elif pattern == "unstructured":
        mask = uniform(n, k) < density
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    return (values * mask).to(dtype=dtype, device=device)
