"""Hugging Face BERT, GPT-2, Llama and ViT, built from configs (nothing is downloaded),
pruned to 2:4 and to block sparsity, compiled both ways sparsecc offers:
``sparsecc.compile(model, inputs)`` and ``torch.compile(model, backend="sparsecc")``. For each,
prints the plan's choices, the relative error against the eager model (the accuracy sparsecc
keeps: the compiled model computes the pruned model's function), the weight memory saved and
the time of each.

    python samples/hf_models.py                        # small configs, CPU or GPU
    python samples/hf_models.py --size base --models llama vit
    python samples/hf_models.py --no-inductor          # the backend without Inductor (quicker)
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn

import sparsecc
from sparsecc.backend import make_backend
from sparsecc.ir.numerics import relative_error

PATTERNS = {"2:4": ("2:4",), "block32x32@0.25": ("bsr32",)}


def build(name: str, size: str, batch: int) -> tuple[nn.Module, torch.Tensor]:
    """A model and example inputs; ``small`` configs run in seconds on a CPU, ``base`` are
    the published base sizes (BERT-base, GPT-2 small, a 1B-class Llama, ViT-B/16)."""
    import transformers as hf
    small = size == "small"
    seq = 32 if small else 128
    if name == "bert":
        config = hf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                               vocab_size=1000) if small else hf.BertConfig()
        return hf.BertModel(config, add_pooling_layer=False), torch.randint(0, config.vocab_size, (batch, seq))
    if name == "gpt2":
        config = hf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, use_cache=False,
                               bos_token_id=0, eos_token_id=0) if small \
            else hf.GPT2Config(use_cache=False)
        return hf.GPT2Model(config), torch.randint(0, config.vocab_size, (batch, seq))
    if name == "llama":
        config = hf.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=1000, use_cache=False) if small else \
            hf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32000, use_cache=False)
        return hf.LlamaModel(config), torch.randint(0, config.vocab_size, (batch, seq))
    if name == "vit":
        config = hf.ViTConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                              image_size=64, patch_size=16) if small else hf.ViTConfig()
        return hf.ViTModel(config, add_pooling_layer=False), torch.randn(batch, 3, config.image_size, config.image_size)
    raise ValueError(f"unknown model {name!r}")


def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


def timed_ms(fn, device: torch.device, repeats: int = 10) -> float:
    samples = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples[2:])[repeats // 2] * 1e3


def run(name: str, pattern: str, *, size="small", batch=4, device=None, inductor=True,
        formats=None, verbose=True) -> dict:
    """Prune one model with ``pattern``, compile it both ways, and measure both against eager."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, inputs = build(name, size, batch)
    model = model.to(device, dtype).eval()
    inputs = inputs.to(device, dtype) if inputs.is_floating_point() else inputs.to(device)
    sparsecc.prune(model, pattern, exclude=["*embed*", "*patch*"])
    torch._dynamo.reset()
    compiled = sparsecc.compile(model, inputs, formats=formats)
    backend = torch.compile(copy.deepcopy(model), backend=make_backend(formats=formats, inductor=inductor))
    plan = compiled.sparsecc_plan
    with torch.no_grad():
        want = first_output(model(inputs))
        result = {"model": name, "pattern": pattern, "device": str(device),
                  "choices": sorted(set(plan.choices().values())),
                  "rel_err_compile": relative_error(first_output(compiled(inputs)), want),
                  "rel_err_backend": relative_error(first_output(backend(inputs)), want),
                  "bytes_before": plan.bytes_before, "bytes_after": plan.bytes_after,
                  "eager_ms": timed_ms(lambda: model(inputs), device),
                  "compile_ms": timed_ms(lambda: compiled(inputs), device),
                  "backend_ms": timed_ms(lambda: backend(inputs), device)}
    if verbose:
        print(f"{name:5s} {pattern:16s} formats {','.join(result['choices']):22s} "
              f"rel.err compile {result['rel_err_compile']:.1e} backend {result['rel_err_backend']:.1e}  "
              f"weights {plan.bytes_before / 2**20:7.2f} -> {plan.bytes_after / 2**20:7.2f} MiB  "
              f"eager {result['eager_ms']:7.2f} ms, compile {result['compile_ms']:7.2f} ms, "
              f"backend {result['backend_ms']:7.2f} ms")
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2", "llama", "vit"])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    parser.add_argument("--size", choices=("small", "base"), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default=None)
    parser.add_argument("--no-inductor", action="store_true", help="run the backend's graphs without Inductor")
    parser.add_argument("--force-formats", action="store_true",
                        help="use each pattern's sparse format wherever it fits, whatever the cost model prefers")
    args = parser.parse_args(argv)
    return [run(name, pattern, size=args.size, batch=args.batch, device=args.device, inductor=not args.no_inductor,
                formats=PATTERNS[pattern] if args.force_formats else None)
            for name in args.models for pattern in args.patterns]


if __name__ == "__main__":
    main()
