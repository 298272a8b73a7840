"""How results are compared: one relative error, used by ``compile``'s check, the tests and the
benchmarks alike."""
from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64; NaN if either has a NaN where the other has
    none (NaNs in the same places are left out of the norms)."""
    got64, want64 = got.detach().double(), want.detach().double()
    if not torch.equal(torch.isnan(got64), torch.isnan(want64)):
        return float("nan")
    got64, want64 = got64.nan_to_num(0.0), want64.nan_to_num(0.0)
    scale = want64.norm().item()
    return (got64 - want64).norm().item() / (scale if scale > 0 else 1.0)
