"""Fine-tuning a pruned model without losing its sparsity.

``prune(..., keep_masks=True)`` stores each layer's mask as a bool buffer ``weight_mask``
of the weight's stored shape. An optimizer step moves pruned weights away from zero
(momentum, weight decay, Adam's update), so :func:`attach_to_optimizer` registers one step
post-hook that zeroes them again after every step: after each ``optimizer.step()`` every
weight satisfies its pattern exactly. :func:`remove_masks` ends fine-tuning: it applies
the masks a last time and deletes the buffers (and the hook), leaving plain sparse weights.

The buffers are ordinary (persistent) buffers, so a checkpoint taken while fine-tuning
holds the masks and resumes exactly; call :func:`remove_masks` before saving the final
model, whose state dict then loads into the unpruned model class.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import InputError

MASK_BUFFER = "weight_mask"


def register_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Store (or replace) ``mask`` (bool, the weight's stored shape) on ``module``."""
    mask = mask.to(device=module.weight.device, dtype=torch.bool)
    if mask.shape != module.weight.shape:
        raise InputError(f"a mask of shape {tuple(mask.shape)} does not fit a weight of shape "
                         f"{tuple(module.weight.shape)}")
    module.register_buffer(MASK_BUFFER, mask.contiguous())


def masked_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that carry a weight mask."""
    return [module for module in model.modules() if getattr(module, MASK_BUFFER, None) is not None]


@torch.no_grad()
def apply_masks(model: nn.Module) -> int:
    """Zero every masked-out weight of ``model``; returns how many modules were masked."""
    modules = masked_modules(model)
    for module in modules:
        module.weight.masked_fill_(~getattr(module, MASK_BUFFER), 0)
    return len(modules)


def attach_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> RemovableHandle:
    """Re-apply ``model``'s weight masks after every ``optimizer.step()``.

    One call sets it up for the rest of training; returns the hook's handle (pass it to
    :func:`remove_masks`, or call ``handle.remove()``).
    """
    return optimizer.register_step_post_hook(lambda _optimizer, _args, _kwargs: apply_masks(model))


def remove_masks(model: nn.Module, handle: RemovableHandle | None = None) -> int:
    """Apply the masks one last time, delete the ``weight_mask`` buffers and, if given, the
    optimizer hook. The weights stay exactly sparse. Returns how many masks were removed."""
    count = apply_masks(model)
    for module in masked_modules(model):
        del module._buffers[MASK_BUFFER]
    if handle is not None:
        handle.remove()
    return count
