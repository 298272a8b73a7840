"""Generation with a KV cache on the CPU: a pruned causal LM compiled by sparsecc generates,
greedily, the tokens the pruned model generates -- Llama, GPT-2, Qwen2 (biased q, k, v) and Mistral
(a sliding window shorter than the text), 2:4 and unstructured (forced
onto sparse formats, which the CPU cost model would not pick at these sizes), the dynamic and the
static cache, a batch with a left-padded row -- with each step's logits within fp32 tolerance and
every step on sparsecc's sparse ops: the prompt at M = batch x prompt length, each new token at
M = batch. The plan of a causal LM covers M from 1 to batch x prompt length; generation also works
under torch.compile and after the model's own ``generate`` compiled its call."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparsecc
from sparsecc import CostModel
from sparsecc.generation import GRAPH_WARMUP, greedy, static_cache

from conftest import rel_error
from models import gpt2_lm, llama, llama_lm, mistral_lm, qwen2_lm

BUILD = {"llama": llama_lm, "gpt2": gpt2_lm, "qwen2": qwen2_lm, "mistral": mistral_lm}
#: the linear layers of one block: Llama (Qwen2, Mistral) q, k, v, o, gate, up, down; GPT-2 c_attn,
#: c_proj, c_fc, c_proj
BLOCK_SITES = {"llama": 7, "gpt2": 4, "qwen2": 7, "mistral": 7}
#: the sparse ops one block calls: q, k and v read the same input and share one call, as do gate and up
BLOCK_CALLS = {"llama": 4, "gpt2": 4, "qwen2": 4, "mistral": 4}
LAYERS = 2
#: pruning pattern -> the formats compile is restricted to
PATTERNS = {"2:4": ("2:4",), "unstructured@0.3": ("csr",)}
#: embeddings and the LM head stay dense, as in practice
EXCLUDE = ["*embed*", "*lm_head*", "*wte*", "*wpe*"]
BATCH, PROMPT, PAD, NEW_TOKENS = 2, 8, 3, 6
#: relative error of a step's logits against the pruned model's (fp32; sparse products sum in another order)
LOGITS_TOLERANCE = 1e-5


class SparseOps(TorchDispatchMode):
    """Counts the calls of sparsecc's sparse ops by the rows M of their input."""

    def __init__(self):
        super().__init__()
        self.rows = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sparsecc" and func.__name__.split(".")[0] != "linear_dense":
            x = args[0]
            self.rows[x.numel() // x.shape[-1]] += 1
        return func(*args, **(kwargs or {}))


def calls(sites) -> int:
    """The sparse op calls that compute ``sites`` (plan entries): one per site, or per group of
    sites that share a call."""
    return len({site.group or site.name for site in sites})


def prompts(vocab: int, batch: int = BATCH, pad: int = PAD, seed: int = 0):
    """Random prompts of PROMPT tokens; every row after the first left-padded with ``pad`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    ids[1:, :pad], mask[1:, :pad] = 0, 0
    return ids, mask


def generate(model, ids, mask, cache):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, cache_implementation=cache, output_logits=True,
                              return_dict_in_generate=True)


def pruned(name: str, pattern: str, seed: int = 0):
    torch.manual_seed(seed)
    model = BUILD[name]()
    sparsecc.prune(model, pattern, exclude=EXCLUDE)
    return model


def assert_same_generation(got, want):
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW_TOKENS
    for step, (have, expected) in enumerate(zip(got.logits, want.logits)):
        error = rel_error(have, expected)
        assert error <= LOGITS_TOLERANCE, f"step {step}: logits relative error {error:.3g}"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", list(BUILD))
def test_greedy_generation_matches_the_pruned_model_on_sparse_ops(name, pattern, cache):
    model = pruned(name, pattern)
    ids, mask = prompts(model.config.vocab_size)
    compiled = sparsecc.compile(model, {"input_ids": ids, "attention_mask": mask}, formats=PATTERNS[pattern])
    sparse = [s for s in compiled.sparsecc_plan if s.choice != "dense"]
    assert len(sparse) >= LAYERS * BLOCK_SITES[name]
    want = generate(model, ids, mask, None if cache == "dynamic" else cache)
    with SparseOps() as ops:
        got = generate(compiled, ids, mask, None if cache == "dynamic" else cache)
    assert_same_generation(got, want)
    # every sparse site ran at every step: the prompt at M = batch x prompt, each new token at M = batch
    # (an LM head computes only the last position's logits, so it may run at M = batch at every step)
    assert sum(ops.rows.values()) == calls(sparse) * NEW_TOKENS
    assert set(ops.rows) == {BATCH * PROMPT, BATCH}
    assert ops.rows[BATCH * PROMPT] >= LAYERS * BLOCK_CALLS[name]


@pytest.mark.parametrize("name", list(BUILD))
def test_one_unpadded_sequence(name):
    model = pruned(name, "2:4", seed=1)
    ids, mask = prompts(model.config.vocab_size, batch=1, seed=1)
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    for cache in (None, "static"):
        assert_same_generation(generate(compiled, ids, mask, cache), generate(model, ids, mask, cache))


def test_the_plan_of_a_causal_lm_covers_every_m_from_one_token_per_sequence_to_the_prompts():
    model = pruned("llama", "2:4")
    ids = torch.randint(3, model.config.vocab_size, (3, 5))
    plan = sparsecc.plan(model, ids, formats=("2:4",))
    for site in plan:
        assert site.m == 15 and site.m_range == [3, 15]
        declared = [(b["m_lo"], b["m_hi"]) for b in site.buckets if b["declared"]]
        assert declared == [(2, 16)]
    # the cost model's own choice says it covers the range
    chosen = sparsecc.plan(model, ids, cost_model=CostModel("cpu", measure=False))
    assert all("M in 3..15" in site.reason for site in chosen if site.shape[0] != model.config.vocab_size)
    # one sequence: from one token
    assert all(site.m_range == [1, 5] for site in sparsecc.plan(model, ids[:1], formats=("2:4",)))
    # a model without an LM head is planned at the example's M, and m_range given wins
    assert all(site.m_range is None for site in sparsecc.plan(llama(), ids[:, :5] % 100, formats=("2:4",)))
    assert all(site.m_range == [4, 8] for site in sparsecc.plan(model, ids, formats=("2:4",), m_range=(4, 8)))


def test_a_call_the_model_compiled_for_generate_before_is_not_reused():
    """Hugging Face's ``generate`` caches a compiled ``__call__`` on the model (with a static cache,
    on the GPU, or wherever compile_config allows): the compiled module must not inherit the
    original's, which would decode with the original's dense layers."""
    from transformers import CompileConfig
    model = pruned("llama", "2:4")
    config = CompileConfig(backend="eager")
    if not hasattr(config, "_compile_all_devices"):
        pytest.skip("this transformers version compiles generate's call on accelerators only")
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    ids, mask = prompts(model.config.vocab_size)
    torch._dynamo.reset()
    try:
        want = generate(model, ids, mask, "static")
        assert hasattr(model, "_compiled_call")
        compiled = sparsecc.compile(model, {"input_ids": ids, "attention_mask": mask}, formats=("2:4",))
        with SparseOps() as ops:
            got = generate(compiled, ids, mask, "static")
    finally:
        torch._dynamo.reset()
    assert_same_generation(got, want)
    assert ops.rows[BATCH] == LAYERS * BLOCK_CALLS["llama"] * (NEW_TOKENS - 1)


@pytest.mark.slow
def test_generation_under_torch_compile():
    """``compiled.forward = torch.compile(compiled.forward)`` (Inductor; on the GPU add
    mode="reduce-overhead" for CUDA graphs), a static cache kept across calls (as CUDA graphs need
    it): the same tokens call after call, and the graphs Inductor compiled call sparsecc's sparse op."""
    from torch._inductor.compile_fx import compile_fx
    model = pruned("llama", "2:4")
    ids, mask = prompts(model.config.vocab_size)
    compiled = sparsecc.compile(model, {"input_ids": ids, "attention_mask": mask}, formats=("2:4",))
    seen = []

    def inductor(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if "sparsecc" in str(n.target))
        return compile_fx(gm, inputs)

    want = generate(model, ids, mask, "static")
    torch._dynamo.reset()
    try:
        compiled.forward = torch.compile(compiled.forward, backend=inductor, dynamic=False)
        cache = static_cache(compiled, PROMPT + NEW_TOKENS)
        calls = [greedy(compiled, ids, mask, new_tokens=NEW_TOKENS, cache=cache, output_logits=True,
                        return_dict_in_generate=True) for _ in range(GRAPH_WARMUP)]
    finally:
        torch._dynamo.reset()
    for got in calls:
        assert_same_generation(got, want)
    assert seen.count("sparsecc.linear_nm.default") >= 2 * LAYERS * BLOCK_CALLS["llama"]   # prefill and decode
