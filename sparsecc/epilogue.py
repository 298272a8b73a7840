"""The epilogue of a linear site: what happens to ``x @ W^T`` before it is stored.

``y = act(x @ W^T + bias)``, optionally stored transposed. Activations are an enum: only
these names ever reach a kernel template or a custom op.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import InputError


class Activation(str, enum.Enum):
    NONE = "none"
    RELU = "relu"
    GELU = "gelu"            # exact (erf) GELU
    GELU_TANH = "gelu_tanh"  # tanh approximation
    SILU = "silu"

    @classmethod
    def parse(cls, value: "str | Activation") -> "Activation":
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"unknown activation {value!r}; use one of "
                             f"{[a.value for a in cls]}") from None


#: the code of each activation in generated kernels (their epilogue takes it at run time)
ACTIVATION_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

#: added to the activation code of a 2:4 GEMM call: skip the pass that makes NaN and Inf of
#: x propagate as in dense (SPARSECC_NONFINITE=unchecked; see sparsecc.config)
UNCHECKED_NONFINITE = 0x100


def apply_activation(y: torch.Tensor, activation: "Activation | str") -> torch.Tensor:
    """Apply ``activation`` out of place (the reference the kernels are held to)."""
    act = Activation.parse(activation)
    if act is Activation.NONE:
        return y
    if act is Activation.RELU:
        return F.relu(y)
    if act is Activation.GELU:
        # GELU(+Inf) = +Inf, as in fp64 and the kernels' epilogue: torch 2.13's vectorised
        # float32 erf GELU gives NaN there on some CPUs (AVX-512)
        return torch.where(y == float("inf"), y, F.gelu(y))
    if act is Activation.GELU_TANH:
        return F.gelu(y, approximate="tanh")
    return F.silu(y)


@dataclass(frozen=True)
class Epilogue:
    """What a site absorbed: a bias per output feature, an activation, a transposed store."""

    bias: bool = False
    activation: Activation = Activation.NONE
    transpose_out: bool = False

    def __str__(self) -> str:
        parts = (["bias"] if self.bias else []) + \
                ([self.activation.value] if self.activation is not Activation.NONE else []) + \
                (["T"] if self.transpose_out else [])
        return "+".join(parts) or "none"
