"""Input-feature norms of linear layers, measured by running the model on calibration batches.

Activation-aware criteria (Wanda) weigh each weight W_ij by how large its input feature j
is in practice: ``||X_j||_2``, the L2 norm of feature j over every token of every batch.
:func:`input_norms` measures it for the chosen layers in one pass over the batches: a
forward pre-hook on each layer adds the squares of its input, per feature, into an fp32
(fp64 for fp64 inputs) accumulator on the layer's device. The model runs under
``torch.no_grad()`` and in eval mode (dropout would scale the inputs; each module's training
flag is restored afterwards). The hooks are removed even if a batch fails.

A batch is what the model is called with: a tensor (``model(x)``), a tuple or list
(``model(*batch)``) or a dict (``model(**batch)``); its tensors are moved to the device of
the model's first parameter.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..errors import InputError
from .selection import is_conv1d


def check_calibration(criterion, calibration) -> None:
    """Raise InputError unless calibration data is given exactly when the criterion needs it."""
    if criterion == "wanda" and calibration is None:
        raise InputError("criterion='wanda' weighs each weight by the norm of its input feature, "
                         "so it needs calibration data: pass calibration=batches, an iterable of "
                         "example inputs as the model is called (tensors, tuples or dicts), e.g. "
                         "a few hundred tokens' worth of real data")
    if criterion != "wanda" and calibration is not None:
        raise InputError(f"calibration= is only used by criterion='wanda'; criterion={criterion!r} "
                         "looks at the weights alone: drop calibration= or pass criterion='wanda'")


@torch.no_grad()
def input_norms(model: nn.Module, layers: list[tuple[str, nn.Module]],
                batches: Iterable) -> dict[str, torch.Tensor]:
    """Per layer name, ``||X_j||_2`` for each input feature j (a float tensor [in features])
    over all tokens the layer saw while ``model`` ran on ``batches``.

    Raises InputError if ``batches`` is empty or not iterable, or if a layer never ran (its
    norms would be meaningless).
    """
    sums: dict[str, torch.Tensor] = {}
    rows = {name: 0 for name, _ in layers}

    def hook_for(name: str, module: nn.Module):
        features = module.weight.shape[0] if is_conv1d(module) else module.weight.shape[1]

        def hook(_module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            x = x.detach().reshape(-1, features)
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            x = x.to(dtype)
            if name not in sums:
                sums[name] = torch.zeros(features, dtype=dtype, device=x.device)
            sums[name] += torch.einsum("tk,tk->k", x, x)
            rows[name] += x.shape[0]
        return hook

    handles = [module.register_forward_pre_hook(hook_for(name, module), with_kwargs=True)
               for name, module in layers]
    training = {module: module.training for module in model.modules()}
    model.eval()
    count = 0
    try:
        for batch in _iterate(batches):
            _call(model, batch)
            count += 1
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in training.items():
            module.training = flag
    if not count:
        raise InputError("calibration is empty: pass at least one batch of example inputs")
    silent = [name for name, seen in rows.items() if not seen]
    if silent:
        raise InputError(f"layer(s) {', '.join(map(repr, silent))} never ran on the calibration "
                         "batches, so their inputs have no norms: exclude= them, or pass batches "
                         "that reach them")
    return {name: total.sqrt() for name, total in sums.items()}


def _iterate(batches):
    if isinstance(batches, (torch.Tensor, dict)):
        raise InputError("calibration takes an iterable of batches, e.g. [x1, x2] or a "
                         "DataLoader; wrap a single batch in a list: calibration=[x]")
    try:
        return iter(batches)
    except TypeError:
        raise InputError(f"calibration must be an iterable of batches, got "
                         f"{type(batches).__name__}") from None


def _call(model: nn.Module, batch) -> None:
    device = next((p.device for p in model.parameters()), None)
    move = (lambda t: t.to(device) if isinstance(t, torch.Tensor) and device is not None else t)  # noqa: E731
    if isinstance(batch, torch.Tensor):
        model(move(batch))
    elif isinstance(batch, (tuple, list)):
        model(*[move(item) for item in batch])
    elif isinstance(batch, dict):
        model(**{key: move(value) for key, value in batch.items()})
    else:
        raise InputError(f"a calibration batch is a tensor, a tuple/list or a dict of model "
                         f"inputs, got {type(batch).__name__}")
