"""Tensor parallelism: a sparse Llama sharded over N GPUs with PyTorch's own ``parallelize_module``,
dense against sparsecc, decode tokens per second and prefill time. Run it with torchrun, once per
world size:

    torchrun --nproc-per-node 1 benchmarks/tensor_parallel.py
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py
    torchrun --nproc-per-node 4 benchmarks/tensor_parallel.py
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --device cpu --tiny   # a smoke run (gloo)

The model is a LlamaForCausalLM with Llama-3-8B's widths (hidden 4096, MLP 14336, 32 heads, 8 KV
heads; a 32k vocabulary) and ``--layers`` layers (default 4), fp16, built on every rank from the
same seed, pruned with ``sparsecc.prune`` (embeddings and the LM head left dense) to each pattern
(``2:4``, ``block64x64@0.1``), then sharded: q/k/v/gate/up ``ColwiseParallel``, o/down
``RowwiseParallel`` (each rank keeps its share of the heads, as in torch's Llama TP recipe). The
``dense`` impl is that sharded model; ``sparsecc`` is ``sparsecc.compile`` of it on every rank,
planned once for all ranks, each rank running its local shards (``--force-formats``: each
pattern's format wherever it fits). Both run under the same ``--compile-mode`` (torch.compile of the
model's forward: ``default``, ``reduce-overhead`` or ``none``) and the same cache.

Per (pattern, batch): ``--prompt`` random tokens per sequence (default 2048: the prefill at batch 1
is 2048 tokens), ``--new-tokens`` generated greedily (sparsecc.generation.time_generate_each, the
impls' calls interleaved; medians of ``--repeats``): ``ttft_ms`` is the prefill (prompt to first
token), ``tokens_per_s`` the decode rate. Rank 0 writes ``results/tensor_parallel_tp<N>-<gpu>-<date>
.json`` with ``world_size`` on every row and a plot; ``--plot FILE...`` draws several world sizes
together.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, fixed_dispatch, plot_generation_speedups, write  # noqa: E402
from generate import format_of, set_recompile_limit  # noqa: E402

if __name__ == "__main__":
    fixed_dispatch()        # SPARSECC_TUNE=off: the shipped table's launches, as the other benchmarks

import sparsecc  # noqa: E402
from sparsecc.generation import GRAPH_WARMUP, time_generate_each  # noqa: E402

PATTERNS = ("2:4", "block64x64@0.1")
EXCLUDE = ["*embed*", "*lm_head*"]
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def build(layers: int, *, tiny: bool, device: torch.device, dtype: torch.dtype):
    """The Llama of the module docstring (``tiny``: hidden 128, MLP 512, 4 heads, 2 KV heads)."""
    import transformers as hf
    widths = (dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512, max_position_embeddings=512) if tiny else
              dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   vocab_size=32000, max_position_embeddings=8192))
    torch.manual_seed(0)
    with torch.device(device):
        model = hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=layers, **widths))
    return model.to(dtype).eval()


def shard(model, mesh) -> None:
    """Tensor-parallel in place: the attention and MLP projections of every layer, heads split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in range(len(model.model.layers)):
        plan.update({f"model.layers.{i}.{name}": ColwiseParallel() for name in COLWISE})
        plan.update({f"model.layers.{i}.{name}": RowwiseParallel() for name in ROWWISE})
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:                       # each rank computes its share of the heads
        attention = layer.self_attn
        for name in ("num_heads", "num_key_value_heads"):
            if hasattr(attention, name):
                setattr(attention, name, getattr(attention, name) // mesh.size())


def compiled(model, mode: str):
    if mode != "none":
        model.forward = torch.compile(model.forward, mode=mode, dynamic=False)
        model.generation_config.disable_compile = True
    return model


def run_case(pattern: str, batches: list[int], args, mesh, device, dtype) -> list[dict]:
    torch._dynamo.reset()
    model = build(args.layers, tiny=args.tiny, device=device, dtype=dtype)
    report = sparsecc.prune(model, pattern, exclude=EXCLUDE)
    shard(model, mesh)
    rows = []
    for batch in batches:
        started = time.perf_counter()
        prompts = torch.randint(1, model.config.vocab_size, (batch, args.prompt), device=device,
                                generator=torch.Generator(device).manual_seed(batch))
        sparse = sparsecc.compile(model, prompts, formats=(format_of(pattern),) if args.force_formats else None)
        plan = sparse.sparsecc_plan
        if args.build_only:
            continue
        dense = compiled(model, args.compile_mode)
        sparse = compiled(sparse, args.compile_mode)
        cache = "static" if args.compile_mode == "reduce-overhead" else None
        warmup = GRAPH_WARMUP if args.compile_mode == "reduce-overhead" else 1
        timings = time_generate_each({"dense": dense, "sparsecc": sparse}, prompts, new_tokens=args.new_tokens,
                                     cache=cache, repeats=args.repeats, warmup=warmup)
        choices = {}
        for site in plan:
            choices[site.choice] = choices.get(site.choice, 0) + 1
        for impl, timing in timings.items():
            rows.append({"impl": impl, "world_size": mesh.size(), "pattern": pattern,
                         "format": "dense" if impl == "dense" else pattern, "layers": args.layers,
                         "compile_mode": args.compile_mode, "batch": batch, "prompt": args.prompt,
                         "new_tokens": args.new_tokens, "M": batch * args.prompt,
                         "dtype": str(dtype).replace("torch.", ""), "density": round(report.density, 4),
                         "ttft_ms": round(timing.ttft_ms, 3),
                         "tokens_per_s": round(timing.tokens_per_s, 1) if timing.tokens_per_s else None,
                         "choices": None if impl == "dense" else choices,
                         "weight_bytes_per_rank": plan.bytes_before if impl == "dense" else plan.bytes_after})
        if dist.get_rank() == 0:
            dense_row, sparse_row = rows[-2], rows[-1]
            print(f"tp{mesh.size()} {pattern:16s} b{batch:<3d} prefill {dense_row['ttft_ms']:9.2f} -> "
                  f"{sparse_row['ttft_ms']:9.2f} ms   decode {dense_row['tokens_per_s'] or 0:9.1f} -> "
                  f"{sparse_row['tokens_per_s'] or 0:9.1f} tokens/s   ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        model.forward = type(model).forward.__get__(model)    # uncompiled again for the next batch
    return rows


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per sequence (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-mode", choices=["default", "reduce-overhead", "none"], default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama of width 128, for a smoke run")
    parser.add_argument("--force-formats", action="store_true")
    parser.add_argument("--build-only", action="store_true", help="compile (build kernels), time nothing")
    parser.add_argument("--out", default=None, help="write the results JSON here instead of benchmarks/results")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="only plot existing results files together")
    args = parser.parse_args(argv)
    if args.plot:
        rows = [r for f in args.plot for r in json.loads(Path(f).read_text())["rows"]]
        plot({**json.loads(Path(args.plot[0]).read_text()), "rows": rows}, Path(args.plot[0]).with_suffix(".png"))
        return None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu --tiny for a smoke run)")
    if "WORLD_SIZE" not in os.environ:
        parser.error("run it with torchrun --nproc-per-node N (N = the tensor-parallel size)")
    from torch.distributed.device_mesh import init_device_mesh
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    set_recompile_limit()
    result = environment("tensor_parallel")
    result.update(transformers=__import__("transformers").__version__, world_size=dist.get_world_size())
    for pattern in args.patterns:
        result["rows"] += run_case(pattern, args.batches, args, mesh, device, dtype)
    path = None
    if dist.get_rank() == 0 and not args.build_only:
        if args.out:
            path = Path(args.out)
            path.write_text(json.dumps(result, indent=1))
        else:
            path = write(result, stem=f"tensor_parallel_tp{dist.get_world_size()}")
            plot(result, path.with_suffix(".png"))
        print("wrote", path)
    dist.destroy_process_group()
    return result


def plot(result: dict, path) -> None:
    """sparsecc's speedup over dense per (world size, pattern, batch): prefill time and decode rate."""
    rows = sorted(result["rows"], key=lambda row: (row["world_size"], row["pattern"], row["batch"]))
    plot_generation_speedups(
        {**result, "rows": rows}, path, lambda row: (row["world_size"], row["pattern"], row["batch"]),
        lambda case: f"tp{case[0]} {case[1]}\nbatch {case[2]}", first_label="prefill",
        title=f"tensor parallel, {result['device']}, torch {result['torch']}")

if __name__ == "__main__":
    main()
