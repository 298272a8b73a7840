"""sparsecc.grouped_attention: at one query token the grouped query heads run on the key/value
heads as they are (no copy per query head), with the attention of an fp64 reference; generation
with it gives the tokens of Hugging Face's SDPA attention, on the dense and the compiled model,
with the dynamic and the static cache and under torch.compile."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparsecc
from sparsecc.errors import InputError
from sparsecc.generation import greedy, greedy_loop, static_cache
from sparsecc.grouped_attention import NAME, grouped_query_attention, use_grouped_attention

from conftest import rel_error
from models import gpt2_lm, llama_lm, mistral_lm, mlp, qwen2_lm

#: fp32 attention against the fp64 reference (sums of 9 terms of order 1)
TOLERANCE = 1e-5
EXCLUDE = ["*embed*", "*lm_head*", "*wte*", "*wpe*"]


class _Groups(torch.nn.Module):
    """What the attention function reads of the attention module: its query heads per key/value head."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def _reference(query, key, value, mask, scale):
    """softmax(q k^T * scale, masked) v in fp64, each query head on its key/value head h // groups."""
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, dim=1)
    value = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ key.transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("per_head_mask", [False, True])
def test_one_query_token_matches_the_fp64_attention(per_head_mask):
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 8, 2, 9, 16
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = torch.rand(batch, heads if per_head_mask else 1, 1, length) > 0.3
    mask[..., 0] = True                                   # every row attends somewhere
    out, weights = grouped_query_attention(_Groups(heads // kv_heads), query, key, value, mask, scaling=0.25)
    assert weights is None and out.shape == (batch, 1, heads, dim)
    assert rel_error(out, _reference(query, key, value, mask.expand(batch, heads, 1, length), 0.25)) < TOLERANCE


def test_a_prompt_goes_to_hugging_faces_sdpa_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    module = _Groups(4)
    module.is_causal = True
    got, _ = grouped_query_attention(module, query, key, value, None, scaling=0.25)
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    assert torch.equal(got, want)


class _KeyHeads(TorchDispatchMode):
    """The key heads and query rows of every SDPA kernel call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.calls.append((args[1].shape[1], args[0].shape[2]))
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_the_key_value_heads_as_they_are():
    torch.manual_seed(0)
    model = use_grouped_attention(llama_lm())              # 4 query heads, 2 key/value heads
    ids = torch.randint(3, 256, (2, 6))
    with _KeyHeads() as seen:
        greedy(model, ids, new_tokens=3, cache="static")
    assert len(seen.calls) == 2 * 3                      # 2 layers: the prompt and 2 steps (the last token is not fed back)
    assert seen.calls[2:] == [(2, 2)] * 4                # each step: 2 key/value heads, 2 query rows each


@pytest.mark.parametrize("make", [llama_lm, qwen2_lm, mistral_lm, gpt2_lm])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_gives_the_tokens_of_sdpa_attention(make, cache):
    """Left-padded prompts (a mask at every step); Mistral's window is shorter than the text; GPT-2
    has no grouped heads and runs SDPA's own path."""
    torch.manual_seed(0)
    model = make()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 256, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want = greedy(model, ids, mask, new_tokens=8, cache=cache)
    grouped = use_grouped_attention(copy.deepcopy(model))
    assert grouped.config._attn_implementation == NAME and model.config._attn_implementation == "sdpa"
    assert torch.equal(greedy(grouped, ids, mask, new_tokens=8, cache=cache), want)


def test_a_compiled_sparse_model_generates_alike_under_torch_compile():
    """sparsecc.compile keeps the attention modules: switching before or after compile is the same;
    under torch.compile the greedy loop's tokens are unchanged."""
    torch.manual_seed(0)
    model = llama_lm()
    model.generation_config.eos_token_id = None
    sparsecc.prune(model, "2:4", exclude=EXCLUDE)
    ids = torch.randint(3, 256, (2, 6))
    want = greedy(model, ids, new_tokens=6)
    before = sparsecc.compile(use_grouped_attention(copy.deepcopy(model)), ids, formats=("2:4",))
    after = use_grouped_attention(sparsecc.compile(model, ids, formats=("2:4",)))
    assert model.config._attn_implementation == NAME           # the compiled form shares the model's config
    for runner in (before, after):
        assert runner.config._attn_implementation == NAME
        assert torch.equal(greedy(runner, ids, new_tokens=6, cache="static"), want)
    torch._dynamo.reset()
    after.forward = torch.compile(after.forward, dynamic=False)
    assert torch.equal(greedy_loop(after, ids, new_tokens=6, cache=static_cache(after, 12)), want)


def test_what_it_refuses():
    with pytest.raises(InputError, match="takes a Hugging Face model; got Sequential"):
        use_grouped_attention(mlp())
    model = llama_lm()
    model.set_attn_implementation("eager")
    with pytest.raises(InputError, match="this model's attention is 'eager'"):
        use_grouped_attention(model)
    model.set_attn_implementation("sdpa")
    assert use_grouped_attention(use_grouped_attention(model)) is model
