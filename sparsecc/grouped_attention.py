"""Grouped-query attention at one query token, without a copy of the cache per query head.

In grouped-query attention (Llama 3, Qwen2, Mistral) several query heads share one key/value head.
Hugging Face's SDPA attention hands ``scaled_dot_product_attention`` as many key/value heads as
query heads: under ``torch.compile``, and wherever it must pass a mask, it first copies each
key/value head once per query head that reads it (``repeat_kv``). For a decode step that copy is
most of the attention's work: the whole cache, written out again ``groups`` times and read back.

At one query token nothing needs copying: the ``groups`` query heads that share a key/value head
are ``groups`` rows of one query against that head, with the same mask (one token has one row of
mask). :func:`grouped_query_attention` lays them out that way and calls SDPA once per key/value
head; every other call (a prompt, dropout, a per-head bias, a soft cap) goes to Hugging Face's
SDPA attention unchanged. Each output is the same softmax-weighted sum of the same values as
before; only the attention kernel's order of summation can differ.

:func:`use_grouped_attention` switches a model to it. It is a choice about the attention, not about
the linear layers, so benchmarks give it to the dense model and to sparsecc's alike.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import InputError

#: the name under which the attention (and its mask, SDPA's) is registered with transformers
NAME = "sparsecc_grouped_sdpa"


def grouped_query_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """An attention function of transformers' ``AttentionInterface``: query ``[b, heads, q, d]``,
    key and value ``[b, kv_heads, kv, d]``; returns ``([b, q, heads, d_v], None)``. At one query
    token of a model with grouped key/value heads it runs SDPA on the key/value heads as they are;
    anything else goes to Hugging Face's ``sdpa_attention_forward``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward   # optional dependency
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    rows = query.reshape(batch, heads // groups, groups, dim)      # query head h reads key/value head h // groups
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:                  # a mask per query head: the same regrouping
        mask = mask.reshape(mask.shape[0], heads // groups, groups, mask.shape[-1])
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], 1, heads, value.shape[-1]), None


def use_grouped_attention(model: nn.Module) -> nn.Module:
    """Switch a Hugging Face model from SDPA attention to :func:`grouped_query_attention` (in place;
    returns the model). A model compiled by sparsecc keeps its attention modules and its config, so
    this works before or after ``sparsecc.compile``, and switches the model and its compiled form
    together (the attention is a setting of the config they share). Refuses a model that is not on
    SDPA attention: another implementation (eager, flash) is the user's choice and is left to them."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or current is None:
        raise InputError(f"use_grouped_attention takes a Hugging Face model; got {type(model).__name__}")
    if current == NAME:
        return model
    if current != "sdpa":
        raise InputError(f"use_grouped_attention replaces SDPA attention; this model's attention is {current!r}")
    _register()
    model.set_attn_implementation(NAME)
    return model


def _register() -> None:
    """Register the attention and SDPA's mask under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface                                   # optional dependency
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, grouped_query_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
