"""Time one linear site the way a compiled model runs it, on the CPU or the GPU.

What the cost model is calibrated on, what launch tuning measures and what the benchmarks check
them with: all time through :func:`packed_runner` and :func:`time_us`, so a prediction and its
measurement mean the same thing.

- On the CPU: the fastest of several wall-clock runs (the least disturbed by other work);
  runners compared with one another are timed in interleaved rounds (:func:`time_all_us`).
- On the GPU: kernel time, the median per call of a CUDA graph of many calls replayed back
  to back (host overhead removed, as under ``mode="reduce-overhead"``), cycling through
  enough copies of the weight that it is read from memory, not the L2 cache. An op that cannot be
  captured (torch's BSR and CSR paths read a value back to the host: see
  :data:`HOST_SYNCING_KINDS`; sparsecc's BSR kernels do not) is timed eagerly with a synchronisation per call, which is what
  it costs in a model.
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from ..ir.epilogue import Epilogue
from ..ir.formats import PackedWeight
from .torch_ops import OP_FOR_KIND

#: formats whose torch implementation reads a value back to the host on every call (the
#: non-finite check of sparsecc.runtime.torch_ops), so a CUDA graph cannot capture them
HOST_SYNCING_KINDS = ("bsr", "csr")


#: on the GPU, a site's weight is copied until the copies exceed this many bytes and the calls
#: cycle through them, so a weight is read from memory, not from the 50 MB L2 cache, as in a
#: model whose layers each read their own weight once
ROTATE_BYTES = 128 << 20
MAX_COPIES = 32


def copies_for(nbytes: int, max_copies: int = MAX_COPIES) -> int:
    """How many copies of ``nbytes`` of weights make :data:`ROTATE_BYTES` (at most ``max_copies``)."""
    return max(1, min(max_copies, -(-ROTATE_BYTES // max(nbytes, 1))))


def packed_runner(packed: PackedWeight, m: int, device: torch.device, *, on_kernel: bool = True,
                  epilogue: Epilogue | None = None, x_dtype: torch.dtype | None = None) -> Callable[[], torch.Tensor]:
    """A no-argument function computing ``x @ W^T`` for random ``x`` with ``m`` rows through the
    op of ``packed`` (a weight packed for sparsecc's kernels when ``on_kernel``, else in a
    portable format), with ``epilogue``'s random bias and activation where given: a site runs
    them too, and what they cost differs between a kernel's fused epilogue and torch's ops.
    ``run.copies`` is how many copies of the packed weight (see :data:`ROTATE_BYTES`) its calls
    cycle through; ``run.x`` and ``run.bias`` are the input and the bias (None: none). ``x`` is in
    ``x_dtype`` where the weight's dtype is not the input's (a quantized weight's), and the weight's
    ``runner_args`` go where a site passes arguments of its own (a quantized site's scales)."""
    op = getattr(packed, "op", None) or OP_FOR_KIND[packed.spec.kind]
    x_dtype = x_dtype or packed.dtype
    x = torch.randn(m, packed.shape[1], dtype=x_dtype, device=device)
    epilogue = epilogue or Epilogue()
    bias = torch.randn(packed.shape[0], dtype=x_dtype, device=device) if epilogue.bias else None
    runner_args = packed.runner_args() if hasattr(packed, "runner_args") else ()
    args = (x, *packed.tensors().values(), *runner_args, *packed.scalars().values(), bias,
            epilogue.activation.value, False, False, *getattr(packed, "extra_args", ()))
    copies = 1
    if torch.device(device).type == "cuda":
        nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        copies = copies_for(nbytes)
    sets = [args] + [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for _ in range(copies - 1)]
    turn = itertools.cycle(sets)

    def run():
        return op(*next(turn))
    run.capturable = on_kernel or packed.spec.kind not in HOST_SYNCING_KINDS   # sparsecc's kernels never sync
    run.copies = copies
    run.x, run.bias = x, bias       # every copy holds the same values
    return run


def time_us(fn: Callable[[], object], device: torch.device | str, *, budget_s: float = 0.05) -> float:
    """Microseconds per call of ``fn`` on ``device`` (see the module docstring); on the GPU
    ``fn`` is replayed from a CUDA graph unless it has ``capturable = False``."""
    device = torch.device(device)
    with torch.no_grad():
        if device.type == "cuda":
            return _time_cuda(fn, budget_s, getattr(fn, "capturable", True))
        return _time_cpu(fn, budget_s)


#: on the CPU, runners compared with one another are timed in this many interleaved rounds,
#: each keeping its fastest: a burst of other work on a shared machine then slows one round
#: of every runner instead of every round of one
CPU_ROUNDS = 5


def time_all_us(runners: dict[str, Callable[[], object]], device: torch.device | str) -> dict[str, float]:
    """:func:`time_us` of each runner, for comparing them: on the GPU one measurement each
    (kernel times under graph replay are steady); on the CPU :data:`CPU_ROUNDS` rounds over all
    of them, the fastest of each kept."""
    device = torch.device(device)
    best: dict[str, float] = {}
    for _ in range(CPU_ROUNDS if device.type == "cpu" else 1):
        for name, fn in runners.items():
            best[name] = min(time_us(fn, device), best.get(name, float("inf")))
    return best


def host_us(fn: Callable[[], object], *, calls: int = 20, rounds: int = 3) -> float:
    """Host microseconds per call of ``fn`` on the GPU: the time to issue ``calls`` calls back to
    back (launches queue, nothing waits for the GPU), the fastest of ``rounds``. What a call
    costs a model whose ops run one by one from the host, not from a CUDA graph."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return best


def reference_us() -> float:
    """Microseconds of a fixed CPU product (fp32, 64x512 by 512x512), the fastest of three
    rounds: how fast this CPU runs right now. A shared VM's speed drifts by tens of percent
    over minutes; the cost model scales CPU predictions by this against its calibration's."""
    x = torch.ones(64, 512)
    w = torch.full((512, 512), 0.5)
    with torch.no_grad():
        return min(_time_cpu(lambda: torch.nn.functional.linear(x, w), 0.01) for _ in range(3))


def _time_cpu(fn, budget_s: float, *, repeats: int = 7) -> float:
    fn()
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return min(samples)


def _events_us(run, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _time_cuda(fn, budget_s: float, capturable: bool) -> float:
    copies = getattr(fn, "copies", 1)
    for _ in range(copies):
        fn()
    torch.cuda.synchronize()
    once = _events_us(fn, copies)
    if not capturable:
        def synced():
            fn()
            torch.cuda.synchronize()
        calls = max(3, min(50, int(budget_s * 1e6 / max(once, 1.0))))
        return statistics.median(_events_us(synced, 1) for _ in range(calls))
    # enough calls per graph (a multiple of the weight copies) that a replay outlasts its launch
    per_graph = copies * max(1, min(64 // copies, -(-300 // max(int(once * copies), 1))))
    graph = capture_graph(fn, per_graph)
    graph.replay()
    graph_us = _events_us(graph.replay, 1)
    replays = max(1, min(20, int(2000 / max(graph_us, 1.0))))      # ~2 ms per measurement
    groups = max(3, min(15, int(budget_s * 1e6 / max(graph_us * replays, 1.0))))
    return statistics.median(_events_us(graph.replay, replays) for _ in range(groups)) / per_graph


def capture_graph(fn, calls: int) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of ``fn``, after a warm-up call on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
