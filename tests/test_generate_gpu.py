"""Generation on sparsecc's 2:4 kernels (fp16, a Hopper GPU): a pruned Llama compiled by sparsecc
generates with the static cache eagerly (``disable_compile``: generate would compile the decode
step itself on the GPU) and with its forward under
``torch.compile(mode="reduce-overhead")`` (CUDA graphs, one static cache kept across calls); every
step runs the kernels, at M = batch x prompt for the prompt and M = batch for each new token, and
each step's logits stay within fp16 tolerance of the pruned model's until the two texts part (fp16
sums in another order can flip a near-tie; after it they continue different texts)."""
import pytest
import torch

import sparsecc
from sparsecc.generation import GRAPH_WARMUP, greedy, static_cache
from sparsecc.grouped_attention import NAME

from conftest import kernels_of_24_sites, rel_error
from models import llama_lm
from test_generate import BATCH, BLOCK_SITES, EXCLUDE, LAYERS, NEW_TOKENS, PROMPT, SparseOps, calls, prompts

pytestmark = pytest.mark.gpu

#: the tiny Llama's weights [N, K]: q and o, k and v, gate and up, down
SHAPES = [(64, 64), (32, 64), (128, 64), (64, 128)]
#: what this module runs, compiled in one parallel build before the first test (conftest)
KERNELS = kernels_of_24_sites(SHAPES, (torch.float16,))
#: relative error of a step's fp16 logits against the pruned model's
TOLERANCE = 1e-2


def steps_alike(got, want) -> int:
    """The steps whose logits were computed from the same tokens in both generations, each within
    TOLERANCE of the other (at least the first)."""
    prompt = want.sequences.shape[1] - len(want.logits)
    steps = 0
    for step, (have, expected) in enumerate(zip(got.logits, want.logits)):
        error = rel_error(have, expected)
        assert error <= TOLERANCE, f"step {step}: logits relative error {error:.3g}"
        steps = step + 1
        if not torch.equal(got.sequences[:, : prompt + step + 1], want.sequences[:, : prompt + step + 1]):
            break
    return steps


def generate(model, ids, mask, cache):
    return greedy(model, ids, mask, new_tokens=NEW_TOKENS, cache=cache, output_logits=True,
                  return_dict_in_generate=True, disable_compile=True)


def under_cuda_graphs(compiled, ids, mask) -> list:
    """``compiled``'s forward under torch.compile(mode="reduce-overhead") on one static cache: its
    generations until the graphs replay (GRAPH_WARMUP calls, then one more)."""
    torch._dynamo.reset()
    try:
        compiled.forward = torch.compile(compiled.forward, mode="reduce-overhead", dynamic=False)
        cache = static_cache(compiled, PROMPT + NEW_TOKENS)
        return [generate(compiled, ids, mask, cache) for _ in range(GRAPH_WARMUP + 1)]
    finally:
        torch._dynamo.reset()


def test_generation_on_the_kernels_eagerly_and_under_cuda_graphs():
    torch.manual_seed(0)
    model = llama_lm().half().cuda()
    sparsecc.prune(model, "2:4", exclude=EXCLUDE)
    ids, mask = (t.cuda() for t in prompts(model.config.vocab_size))
    compiled = sparsecc.compile(model, {"input_ids": ids, "attention_mask": mask}, formats=("2:4",))
    assert sum(s.choice == "2:4" for s in compiled.sparsecc_plan) == LAYERS * BLOCK_SITES["llama"]
    want = generate(model, ids, mask, "static")
    with SparseOps() as ops:
        got = generate(compiled, ids, mask, "static")
    assert steps_alike(got, want) >= 1
    # one per sparse site, or per group of sites sharing one (the dense LM head makes none)
    per_step = calls([s for s in compiled.sparsecc_plan if s.choice != "dense"])
    assert ops.rows == {BATCH * PROMPT: per_step, BATCH: per_step * (NEW_TOKENS - 1)}
    replays = under_cuda_graphs(compiled, ids, mask)
    for graphs in replays:
        assert steps_alike(graphs, want) >= 1
    assert torch.equal(replays[-1].sequences, replays[-2].sequences)      # replayed graphs, same work


def test_grouped_attention_on_the_kernels_under_cuda_graphs():
    """sparsecc.use_grouped_attention on the GPU: the compiled 2:4 model, its decode steps reading
    the key/value heads as they are under CUDA graphs, keeps the pruned model's logits (Hugging
    Face's attention) within fp16 tolerance; a padded row makes every step pass a mask."""
    torch.manual_seed(0)
    model = llama_lm().half().cuda()
    sparsecc.prune(model, "2:4", exclude=EXCLUDE)
    ids, mask = (t.cuda() for t in prompts(model.config.vocab_size))
    want = generate(model, ids, mask, "static")
    compiled = sparsecc.use_grouped_attention(
        sparsecc.compile(model, {"input_ids": ids, "attention_mask": mask}, formats=("2:4",)))
    assert compiled.config._attn_implementation == NAME
    replays = under_cuda_graphs(compiled, ids, mask)
    for graphs in replays:
        assert steps_alike(graphs, want) >= 1
