"""Which layers of a model to prune, and each one's weight in the canonical [out, in] view.

Layers are chosen by type, by module-name globs and by position: see
:func:`select_layers`. Besides ``nn.Linear``, Hugging Face GPT-2's ``Conv1D`` counts as a
linear layer. It computes ``x @ W + b`` with ``W`` stored ``[in, out]`` (the transpose of
``nn.Linear``), so :func:`weight_matrix` returns ``W.t()``: patterns always group along
the INPUT dimension, which for ``Conv1D`` is dim 0 of the stored weight. It is recognised
by class name (``Conv1D`` with ``nf``/``nx`` attributes), so transformers need not be
imported.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable

import torch
from torch import nn

from ..errors import InputError


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (weight stored [in, out])."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The module's weight as [out features, in features]: a view that shares storage, so
    writing into it writes the weight (``Conv1D``'s is the transpose of what it stores)."""
    return module.weight.t() if is_conv1d(module) else module.weight


def select_layers(model: nn.Module, *, include: "str | Iterable[str] | None" = None,
                  exclude: "str | Iterable[str] | None" = None,
                  types: tuple[type, ...] = (nn.Linear,), keep_first: int = 0,
                  keep_last: int = 0) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs to prune, in ``model.named_modules()`` order.

    A module is a candidate when it is an instance of ``types`` (``Conv1D`` modules count
    as ``nn.Linear``), its name matches one of the ``include`` globs (all names when None)
    and none of the ``exclude`` globs (:func:`fnmatch.fnmatchcase`, e.g. ``"h.*.mlp.*"``).
    Then the first ``keep_first`` and last ``keep_last`` candidates are left out (kept
    dense). Raises InputError, naming the filters, when nothing is left.
    """
    include_globs, exclude_globs = _globs(include, "include"), _globs(exclude, "exclude")
    for what, count in (("keep_first", keep_first), ("keep_last", keep_last)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InputError(f"{what} must be an integer >= 0, got {count!r}")
    if not isinstance(model, nn.Module):
        raise InputError(f"prune needs an nn.Module, got {type(model).__name__}")
    types = tuple(types)
    typed = [(name, module) for name, module in model.named_modules()
             if isinstance(module, types) or (nn.Linear in types and is_conv1d(module))]
    candidates = [(name, module) for name, module in typed
                  if (include_globs is None or _matches(name, include_globs))
                  and not _matches(name, exclude_globs or ())]
    selected = candidates[keep_first: len(candidates) - keep_last]
    if not selected:
        raise InputError(_empty_selection_message(typed, candidates, include_globs, exclude_globs,
                                                  types, keep_first, keep_last))
    return selected


def _globs(value, what: str) -> "tuple[str, ...] | None":
    if value is None:
        return None
    globs = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Iterable) else None
    if globs is None or not all(isinstance(glob, str) for glob in globs):
        raise InputError(f"{what} takes module-name globs (a string or a list of strings), "
                         f"got {value!r}")
    return globs


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)


def _empty_selection_message(typed, candidates, include, exclude, types, keep_first,
                             keep_last) -> str:
    type_names = ", ".join(t.__name__ for t in types)
    if not typed:
        return (f"no layer to prune: the model has no module of type {type_names} "
                "(or a Hugging Face Conv1D); pass types= with the layer classes to prune")
    examples = ", ".join(repr(name) for name, _ in typed[:5]) + (", ..." if len(typed) > 5 else "")
    if not candidates:
        return (f"no layer to prune: none of the {len(typed)} layers of type {type_names} matches "
                f"include={list(include) if include else None} exclude={list(exclude) if exclude else None} "
                f"(module names look like {examples}; globs use fnmatch, e.g. 'encoder.*.fc1')")
    return (f"no layer to prune: all {len(candidates)} matching layers are kept dense by "
            f"keep_first={keep_first} and keep_last={keep_last}; lower them")
