"""Generate text with a pruned causal LM compiled by sparsecc: a Llama built from a config (nothing is
downloaded) is pruned to 2:4 and to 90% unstructured sparsity, compiled, and asked to generate
greedily with a KV cache. For each pattern it prints the formats the plan chose and the batch sizes
the plan covers (from one token per sequence, decoding, to the whole prompts, prefill), the time to
the first token and the decode rate of the pruned model and of the compiled one, and whether they
generated the same tokens (they should: compile does not change what the model computes).

    python samples/generate.py                          # a small Llama, on the GPU if there is one
    python samples/generate.py --cache static           # the static cache (CUDA graphs for decode on the GPU)
    python samples/generate.py --size 1b --batch 8      # Llama-3.2-1B's shapes (GPU)
    python samples/generate.py --force-formats          # each pattern's format wherever it fits
    python samples/generate.py --attention sdpa         # Hugging Face's attention (default: grouped, both models)
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

import sparsecc
from sparsecc.generation import GRAPH_WARMUP, time_generate_each
from sparsecc.grouped_attention import use_grouped_attention

#: pruning pattern -> the format that stores it (for --force-formats)
PATTERNS = {"2:4": ("2:4",), "unstructured@0.1": ("csr",)}


def build(size: str):
    """A Llama causal LM: ``small`` runs in seconds on a CPU, ``1b`` has Llama-3.2-1B's shapes."""
    import transformers as hf
    if size == "small":
        config = hf.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512, pad_token_id=0)
    else:
        config = hf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=32000, pad_token_id=0)
    return hf.LlamaForCausalLM(config)


def run(pattern: str, *, size="small", batch=4, prompt=64, new_tokens=32, cache=None, device=None,
        formats=None, repeats=3, attention="grouped", verbose=True) -> dict:
    """Prune a fresh model with ``pattern``, compile it, and time generation by both. ``attention``:
    ``grouped`` (sparsecc.grouped_attention: a decode step reads each key/value head once) or
    Hugging Face's ``sdpa``, the same for both models."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = build(size).to(dtype).eval()
        if attention == "grouped":
            use_grouped_attention(model)
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt))
    sparsecc.prune(model, pattern, exclude=["*embed*", "*lm_head*"])
    compiled = sparsecc.compile(model, ids, formats=formats)       # planned for M = 1 .. batch x prompt
    plan = compiled.sparsecc_plan
    warmup = GRAPH_WARMUP if cache == "static" and device.type == "cuda" else 1   # compile, record CUDA graphs
    timings = time_generate_each({"eager": model, "sparsecc": compiled}, ids, new_tokens=new_tokens, cache=cache,
                                 repeats=repeats, warmup=warmup)          # interleaved, medians
    eager, fast = timings["eager"], timings["sparsecc"]
    result = {"pattern": pattern, "device": str(device), "attention": attention, "choices": dict(Counter(plan.choices().values())),
              "m_range": plan.sites[0].m_range, "same_tokens": torch.equal(eager.sequences, fast.sequences),
              "eager_ttft_ms": eager.ttft_ms, "compiled_ttft_ms": fast.ttft_ms,
              "eager_tokens_per_s": eager.tokens_per_s, "compiled_tokens_per_s": fast.tokens_per_s,
              "bytes_before": plan.bytes_before, "bytes_after": plan.bytes_after}
    if verbose:
        formats_used = ", ".join(f"{name} x{count}" for name, count in sorted(result["choices"].items()))
        lo, hi = result["m_range"]
        print(f"{pattern}: formats {formats_used}; planned for M = {lo} .. {hi}; weights "
              f"{plan.bytes_before / 2**20:.1f} -> {plan.bytes_after / 2**20:.1f} MiB")
        for name, timing in (("pruned model", eager), ("sparsecc", fast)):
            print(f"  {name:>12}: first token {timing.ttft_ms:8.2f} ms, decode {timing.tokens_per_s:9.1f} tokens/s")
        print(f"  same tokens: {'yes' if result['same_tokens'] else 'NO'}")
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    parser.add_argument("--size", choices=("small", "1b"), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cache", choices=("static",), default=None, help="the static KV cache (default: dynamic)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--attention", choices=("grouped", "sdpa"), default="grouped",
                        help="both models' attention: sparsecc's grouped (default) or Hugging Face's sdpa")
    parser.add_argument("--force-formats", action="store_true",
                        help="use each pattern's sparse format wherever it fits, whatever the cost model prefers")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"Llama ({args.size}), batch {args.batch}, prompt {args.prompt} tokens, {args.new_tokens} new, greedy, "
          f"{args.cache or 'dynamic'} cache, on {device}")
    return [run(pattern, size=args.size, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                cache=args.cache, device=device, formats=PATTERNS.get(pattern) if args.force_formats else None,
                attention=args.attention)
            for pattern in args.patterns]


if __name__ == "__main__":
    main()
