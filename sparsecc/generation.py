"""Timing text generation: the time to the first token and the decode rate of ``model.generate``.

A Hugging Face causal LM compiled by sparsecc generates as the model does (``compile`` plans its
linear layers from one token, M = batch, to the prompts, M = batch x prompt length). Generation
has two costs a user feels, and one number hides either: the prompt's forward pass (prefill,
compute-bound) sets the time to the first token, the per-token passes over the cache (decode,
weight-bandwidth-bound at small batch) set the tokens per second after it. One call of
``generate`` gives both: a streamer notes when the first new token reaches the host, and the
decode rate is the tokens generated after it over the time they took. Greedy, with exactly
``new_tokens`` tokens (no early stop at an end-of-sequence token), so two models are timed on
the same work. With ``cache="static"`` each model keeps one static cache across the timed calls,
emptied before each: its tensors stay where they are, so CUDA graphs captured by
``torch.compile(mode="reduce-overhead")`` replay instead of being captured again for every call (a
cache made per call, as ``generate(cache_implementation="static")`` does, moves them). The command
line's ``sparsecc bench --generate``, the sample ``samples/generate.py`` and
``benchmarks/generate.py`` time generation this way.

``generate`` spends host time of its own on every step, and waits for the GPU to decide whether to
go on; at batch 1 under CUDA graphs that is about as long as the forward pass, so it hides much of
what a faster forward gains. :func:`greedy_loop` generates the same greedy tokens with nothing
between two forwards but choosing the next token on the GPU, and ``time_generate(loop=
"greedy_loop")`` times it the same way.
"""
from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import InputError


#: untimed calls before timing a model whose forward is compiled for CUDA graphs with a static
#: cache (torch.compile(mode="reduce-overhead"), or generate's own compile of the decode step): the
#: first compiles and runs the graphs once, the second records them, the third replays them (a
#: margin: prefill and decode are separate graphs, each warmed up on its own)
GRAPH_WARMUP = 3


@dataclass
class GenerationTiming:
    """Medians over the timed calls; ``tokens_per_s`` counts every sequence of the batch (None
    for one new token: no decode step); ``sequences`` are the last call's prompt plus new tokens."""

    ttft_ms: float
    tokens_per_s: float | None
    sequences: torch.Tensor


class FirstTokenClock:
    """A ``generate`` streamer (``put`` / ``end``) that notes when the first new token is on the
    host: ``generate`` puts the prompt first, then each step's tokens after copying them from the
    device (so the step has finished)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            _synchronize(self.device)
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def greedy(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
           new_tokens: int, cache=None, streamer=None, **kwargs):
    """``model.generate`` greedily for exactly ``new_tokens`` tokens. ``cache``: None (the dynamic
    cache), a ``cache_implementation`` such as ``"static"`` (a new cache for the call), or a cache
    object (e.g. :func:`static_cache`'s), emptied first and filled in place. A static cache's tensors
    are made before the first forward (see :func:`_allocate`). Extra keyword arguments
    go to ``generate`` (``output_logits=True, return_dict_in_generate=True`` for the logits)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if cache == "static":
        cache = static_cache(model, input_ids.shape[1] + new_tokens)
    if cache is None or isinstance(cache, str):
        kwargs["cache_implementation"] = cache
    else:
        _allocate(cache, model, input_ids.shape[0])
        cache.reset()
        kwargs[_cache_argument(model)] = cache
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.generation_config, "eos_token_id", None)
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                              pad_token_id=pad if pad is not None else 0, **kwargs)


def greedy_loop(model: nn.Module, input_ids: torch.Tensor, *, new_tokens: int, cache, streamer=None) -> torch.Tensor:
    """Greedy generation of exactly ``new_tokens`` tokens without ``generate``: the prompts'
    forward, then one forward per new token on a static ``cache`` (:func:`static_cache`'s, emptied
    first), each next token the argmax of the last logits, left on the device.

    ``generate`` does work of its own between two forwards (its logits processors and stopping
    checks, and the sync they need to decide whether to go on); with a forward replayed from CUDA
    graphs that work is about as long as the forward at batch 1, and the GPU waits for it. Here
    nothing waits: the host issues step after step while the GPU runs them, so the forward sets
    the pace. The tokens are the ones greedy ``generate`` picks without an end-of-sequence token
    (none stops or is suppressed here). Prompts of one length, unpadded (no attention mask).
    ``streamer``: as ``generate``'s, given the prompts, then each step's tokens (on the device).
    Returns the prompts followed by the new tokens."""
    if cache is None or isinstance(cache, str):
        raise InputError("greedy_loop needs a cache object to fill in place: sparsecc.generation.static_cache(model, n)")
    if new_tokens < 1:
        raise InputError(f"greedy_loop makes at least one token, got new_tokens={new_tokens}")
    batch, length = input_ids.shape
    room = _room(cache)
    if room is not None and room < length + new_tokens:
        raise InputError(f"the cache holds {room} tokens per sequence; prompts of {length} and {new_tokens} new "
                         f"tokens need {length + new_tokens}")
    _allocate(cache, model, batch)
    cache.reset()
    name = _cache_argument(model)
    last_only = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}   # as generate asks
    tokens, token = [input_ids], input_ids
    position = torch.arange(length, device=input_ids.device)
    if streamer is not None:
        streamer.put(input_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=token, cache_position=position, use_cache=True, **{name: cache},
                           **last_only).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            if streamer is not None:
                streamer.put(token)
            position = position[-1:] + 1
    return torch.cat(tokens, dim=1)


def _room(cache) -> int | None:
    """The tokens per sequence a static cache holds, where it keeps all of them (a layer with a
    sliding window keeps its last tokens, whatever the length); None where no layer says."""
    full = [getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", ())
            if not getattr(layer, "is_sliding", False)]
    full = [n for n in full if n is not None]
    return min(full) if full else None


def _allocate(cache, model: nn.Module, batch: int) -> None:
    """Make a static cache's tensors before the first forward. Left to the first forward, they are
    made inside it; under torch.compile they are then not marked static, and CUDA graphs skip the
    graph or fail (a compiled prefill is what this module's graphs mode runs)."""
    layers = getattr(cache, "layers", ())
    if not hasattr(cache, "early_initialization") or all(getattr(layer, "is_initialized", True) for layer in layers):
        return
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameter = next(model.parameters())
    cache.early_initialization(batch, kv_heads, head_dim, parameter.dtype, parameter.device)


def static_cache(model: nn.Module, max_cache_len: int):
    """A Hugging Face static cache for ``model`` holding up to ``max_cache_len`` tokens per sequence,
    to pass to :func:`greedy` call after call (it makes the tensors before the first call)."""
    from transformers import StaticCache         # optional: only causal LMs generate
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def time_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  new_tokens: int, cache=None, repeats: int = 3, warmup: int = 1,
                  loop: str = "generate") -> GenerationTiming:
    """Time greedy generation of ``new_tokens`` tokens after the prompts ``input_ids``: ``warmup``
    untimed calls (:data:`GRAPH_WARMUP` for CUDA graphs), then the medians of ``repeats`` timed ones.
    ``loop``: ``"generate"`` (:func:`greedy`, ``model.generate``) or ``"greedy_loop"``
    (:func:`greedy_loop`: a static cache, no attention mask)."""
    return time_generate_each({"model": model}, input_ids, attention_mask, new_tokens=new_tokens, cache=cache,
                              repeats=repeats, warmup=warmup, loop=loop)["model"]


def time_generate_each(models: dict[str, nn.Module], input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None = None, *, new_tokens: int, cache=None,
                       repeats: int = 3, warmup: int = 1, loop: str = "generate") -> dict[str, GenerationTiming]:
    """:func:`time_generate` for several models (by name) on the same prompts, their timed calls
    interleaved round by round, so a burst of other work on the machine falls on all alike, and the
    order rotated by one each round, so no model always runs right after the same other one."""
    if new_tokens < 1 or repeats < 1 or warmup < 0:
        raise InputError(f"time_generate needs new_tokens >= 1, repeats >= 1 and warmup >= 0, got "
                         f"{new_tokens}, {repeats}, {warmup}")
    if loop not in LOOPS:
        raise InputError(f"loop={loop!r}: the loops are {sorted(LOOPS)}")
    if loop == "greedy_loop" and attention_mask is not None:
        raise InputError("greedy_loop takes prompts of one length without an attention mask")
    run = LOOPS[loop]
    if cache == "static":       # one per model, kept across the calls (see the module docstring)
        caches = {name: static_cache(model, input_ids.shape[1] + new_tokens) for name, model in models.items()}
    elif isinstance(cache, dict):
        caches = cache
    else:
        caches = {name: cache for name in models}
    for name, model in models.items():
        for _ in range(warmup):
            run(model, input_ids, attention_mask, new_tokens=new_tokens, cache=caches[name])
    ttfts: dict[str, list[float]] = {name: [] for name in models}
    rates: dict[str, list[float]] = {name: [] for name in models}
    last = {}
    names = list(models)
    for turn in range(repeats):
        shift = turn % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            ttft, rate, last[name] = _timed_call(run, models[name], input_ids, attention_mask, new_tokens,
                                                 caches[name])
            ttfts[name].append(ttft)
            if rate is not None:
                rates[name].append(rate)
    return {name: GenerationTiming(statistics.median(ttfts[name]),
                                   statistics.median(rates[name]) if rates[name] else None, last[name])
            for name in models}


def _timed_call(run, model, input_ids, attention_mask, new_tokens, cache):
    """One generation by ``run`` (a value of :data:`LOOPS`): (ms to the first token, decode tokens
    per second or None, the sequences)."""
    device = input_ids.device
    clock = FirstTokenClock(device)
    _synchronize(device)
    start = time.perf_counter()
    sequences = run(model, input_ids, attention_mask, new_tokens=new_tokens, cache=cache, streamer=clock)
    _synchronize(device)
    end = time.perf_counter()
    first = clock.first_token_at if clock.first_token_at is not None else end
    rate = input_ids.shape[0] * (new_tokens - 1) / max(end - first, 1e-9) if new_tokens > 1 else None
    return (first - start) * 1e3, rate, sequences


def _greedy_loop(model, input_ids, attention_mask, *, new_tokens, cache, streamer=None):
    """:func:`greedy_loop` called as :func:`greedy` is (the mask is None: time_generate_each checks)."""
    if cache == "static":
        cache = static_cache(model, input_ids.shape[1] + new_tokens)
    return greedy_loop(model, input_ids, new_tokens=new_tokens, cache=cache, streamer=streamer)


#: what generates in a timed call, by name (``time_generate``'s ``loop``)
LOOPS = {"generate": greedy, "greedy_loop": _greedy_loop}


def _cache_argument(model: nn.Module) -> str:
    """The name ``generate`` takes a cache object by: ``cache`` in recent transformers (5.2x),
    ``past_key_values`` before (as the model's forward names it)."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def _takes(model: nn.Module, argument: str) -> bool:
    """Whether the model's forward has a parameter of this name."""
    return argument in inspect.signature(type(model).forward).parameters


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
