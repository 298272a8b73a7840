"""The epilogue of a linear site: what happens to ``x @ W^T`` before it is stored.

``y = act(x @ W^T + bias)``, optionally stored transposed. Activations are an enum: only
these names ever reach a kernel template or a custom op.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError


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


@dataclass(frozen=True)
class GeluPolynomial:
    """Exact (erf) GELU, ``x * Phi(x)``, in about half the instructions of CUTLASS's
    (``erff``: two polynomials merged by selects, then an exp2), for the BSR kernel's
    epilogue, where at ViT-B/16's fc1 (M = 50432) that GELU made the kernel 1.5x slower on
    an H100 (303 against 197 us with ReLU): the epilogue is bound by instructions there.

    With ``t = min(|x|, clamp)``, ``Q = 2 ** p(t)`` approximates the normal tail
    ``Q(t) = erfc(t / sqrt 2) / 2`` (``p``: a polynomial, ``coefficients`` from the constant
    term up, fitted to ``log2 Q`` weighted by ``Q``), and ``Phi(x)`` is ``1 - Q`` for
    ``x >= 0``, ``Q`` below. ``|Q error| < 4e-8`` (float32 evaluation; the GPU's approximate
    exp2 adds up to 2 ulp), about what ``1 + erff(x / sqrt 2)`` reaches, so the result is as
    exact as CUTLASS's and torch's float32 GELU (checked in tests/test_epilogue_config.py on a
    dense grid). At the clamp ``p`` is below -152, where the exp2 gives exactly 0: GELU(-inf)
    is NaN and GELU(+inf) +inf, as in torch; NaN stays NaN."""

    clamp: float
    coefficients: tuple[float, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The GPU's evaluation in float32 on the CPU (its exp2 exact): for tests."""
        x = x.float()
        t = x.abs().clamp(max=self.clamp).nan_to_num(nan=self.clamp)
        p = torch.full_like(t, self.coefficients[-1])
        for c in reversed(self.coefficients[:-1]):
            p = p * t + c
        tail = torch.exp2(p)
        return x * torch.where(x >= 0, 1 - tail, tail)


GELU_POLYNOMIAL = GeluPolynomial(clamp=14.5, coefficients=(
    -0.9999999403953552, -1.151107907295227, -0.4591827392578125, -0.052586399018764496, 0.00721540953963995,
    -0.00027102764579467475, -0.0001229805639013648, 2.4403245333814994e-05, -1.4412721611734014e-06))


def apply_activation(y: torch.Tensor, activation: "Activation | str") -> torch.Tensor:
    """Apply ``activation`` out of place (the reference the kernels are held to)."""
    act = Activation.parse(activation)
    if act is Activation.NONE:
        return y
    if act is Activation.RELU:
        return F.relu(y)
    if act is Activation.GELU:
        # GELU(+Inf) = +Inf, as in fp64 and the kernels' epilogue: torch 2.13's vectorised
        # float32 erf GELU gives NaN there on some CPUs (AVX-512). Only there: elsewhere the
        # compare and select would ride in every dense GELU site Inductor compiles (BERT's
        # GELU kernel took 868 us where Inductor's own took 608, benchmarks/lab/README.md)
        return torch.where(y == float("inf"), y, F.gelu(y)) if y.device.type == "cpu" else F.gelu(y)
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
