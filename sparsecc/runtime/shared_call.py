"""One call for sibling layers that sit in different graphs.

Where a module does not trace whole (a Hugging Face attention: its cache and keyword arguments),
its layers are traced one graph each, and an attention's q, k and v projections are three graphs
called one after the other on the same tensor. A :class:`SharedCall` lets them share one call
anyway: the first member called computes every member's output on the stacked weight and keeps
the others' for them; each later member called on that same tensor, unchanged since, takes its
own. A member called on another tensor, or on the same one written in place in between, or twice,
computes again: a kept output is only ever handed out for the input it was computed from. Once
every member has taken its output nothing is kept, so between model calls the module holds no
activation (unless a member was skipped: then until the next call).

Under ``torch.compile`` Dynamo traces this logic into the model's graph (one call, the others'
outputs passed along). A tensor's version cannot be read there, nor for a tensor made under
``torch.inference_mode()``, so there a tensor written in place between two members' calls is not
noticed. The example run at compile checked that the model does not do so
(``sparsecc.frontend.tracing``: each call's versions; a part called on an inference tensor is
not grouped with others).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class _Kept:
    """What a SharedCall keeps between its members' calls: ``value`` is (x, x's version or None,
    the members still to take theirs, the outputs), or None. A plain object, so that a call
    changes no attribute of the module (under torch.compile, each module attribute written is
    more for Dynamo to check before every call)."""

    def __init__(self):
        self.value = None

    def __getstate__(self):
        return {"value": None}          # an activation is no part of a saved module


class SharedCall(nn.Module):
    """The members' outputs from one call of ``compute`` (x -> a tuple, a member's output each)."""

    def __init__(self, compute: nn.Module, members: int):
        super().__init__()
        self.compute = compute
        self.members = members
        self.kept = _Kept()

    def forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        version = _version(x)
        kept = self.kept.value
        if kept is not None and kept[0] is x and index in kept[2] and kept[1] == version:
            left = tuple(i for i in kept[2] if i != index)
            self.kept.value = (x, version, left, kept[3]) if left else None
            return kept[3][index]
        outputs = self.compute(x)
        left = tuple(i for i in range(self.members) if i != index)
        self.kept.value = (x, version, left, outputs) if left else None
        return outputs[index]


def _version(x: torch.Tensor) -> int | None:
    """x's version counter, or None where it cannot be read: inside a graph Dynamo traces, and
    for a tensor made under ``torch.inference_mode()``, which keeps none."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    return x._version
