"""Check a plan as a whole: the rewritten program timed against the dense one it came from.

The cost model times each site alone. What runs around the sites in a real model (the fusions
and layouts of the code between them, the caches the neighbouring ops leave warm or cold, the
host's pace when ops run one by one) is not in those timings, so a plan whose every site was
timed faster can still make the model slower. ``torch.compile(model, backend="sparsecc")`` and
``sparsecc.compile`` therefore run both programs on the example inputs (the backend: on a graph's
first call's, after Dynamo's compile), where that is safe (:func:`can_run_again`), and keep the
rewritten one only if it is faster by :data:`MARGIN` (:data:`HOST_BOUND_MARGIN` where the host
sets the dense one's pace), or, where the GPU sets it, faster in each round than the dense one in
its fastest (:func:`faster`); otherwise every site runs dense and its reason in the plan says why
(:func:`all_dense`).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from typing import Callable, NamedTuple

import torch
import torch.fx as fx

from ..ir.mutation import writes_in_place
from ..ir.plan import Plan
from ..runtime.timing import capture_graph

log = logging.getLogger("sparsecc")

#: the rewritten program is kept only if it runs in at most this fraction of the dense one's time
MARGIN = 0.98
#: ... or this one, where the dense program is bound by the host (:data:`HOST_BOUND`): then
#: only host time counts, and it varies more between the race and later calls. On an H100,
#: Llama-1B's one-token decode op by op raced 2.4% faster with 32 sparse sites and then ran 7%
#: slower than the dense graph as the benchmark called it; bert-large (bound by the GPU) raced
#: 3.5% faster and ran 3.8% faster.
HOST_BOUND_MARGIN = 0.95
#: a program is bound by the host where issuing its calls took at least this fraction of the
#: time until the GPU was done: the GPU ran out of work while the host was still issuing it
HOST_BOUND = 0.9
#: the two programs are timed in this many interleaved rounds of this many calls each (median kept)
ROUNDS, CALLS = 5, 5

def can_run_again(graphs: list[fx.GraphModule], inputs: list) -> bool:
    """Whether programs made of ``graphs`` may be called a few more times on ``inputs`` to time
    them: the inputs are real tensors and numbers, and no op writes in place (a cache update, a
    counter), so extra calls change nothing."""
    if not all(isinstance(v, (torch.Tensor, int, float, bool)) for v in inputs):
        return False
    if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in inputs):
        return False
    return not any(writes_in_place(node) for gm in graphs for node in gm.graph.nodes)


class Raced(NamedTuple):
    """What :func:`race` measured: microseconds per call of each program (the median round),
    whether the second (the dense one, in a check) is bound by the host (:data:`HOST_BOUND`), and
    each program's rounds (microseconds per call in each)."""

    first_us: float
    second_us: float
    second_host_bound: bool = False
    first_rounds: tuple[float, ...] = ()
    second_rounds: tuple[float, ...] = ()


def race(first: Callable[[], object], second: Callable[[], object], *, cuda: bool) -> Raced:
    """Microseconds per call of ``first()`` and ``second()``: the median of :data:`ROUNDS`
    interleaved rounds (the two lead in turn), each the wall time of :data:`CALLS` calls and the
    wait for the GPU (what a caller sees, whether the host or the GPU sets the pace; ``cuda``: they
    run on the GPU); and
    whether issuing ``second``'s calls took :data:`HOST_BOUND` of that time or more (on the GPU).

    Python's collector is paused while they run (after one collection): a compile leaves many
    objects behind, and a full collection of them lands in whichever rounds it happens to, a
    pause of neither program's making. On an H100 one Inductor graph of Llama-1B's one-token
    decode, timed inside the torch.compile backend, ran 5053 us per call with the collector on
    and 4044 us with it paused."""
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _race(first, second, cuda)
    finally:
        if collecting:
            gc.enable()


def _race(first: Callable[[], object], second: Callable[[], object], cuda: bool) -> Raced:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: list[list[float]] = [[], []]
    issuing: list[list[float]] = [[], []]   # the share of each round's time spent issuing its calls
    with torch.no_grad():
        for fn in (first, second):
            for _ in range(3):               # warm-up; torch.compile's CUDA graphs record on the first calls
                fn()
        runners = list(zip((first, second), times, issuing))
        for turn in range(ROUNDS):          # each leads in turn: neither always runs after the other
            for fn, found, shares in (runners if turn % 2 == 0 else runners[::-1]):
                sync()
                start = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                issued = time.perf_counter() - start
                sync()
                elapsed = time.perf_counter() - start
                found.append(elapsed * 1e6 / CALLS)
                shares.append(issued / elapsed)
    return Raced(statistics.median(times[0]), statistics.median(times[1]),
                 cuda and statistics.median(issuing[1]) >= HOST_BOUND, tuple(times[0]), tuple(times[1]))


def captured(*fns: Callable[[], object]) -> list[torch.cuda.CUDAGraph] | None:
    """Each of ``fns`` captured in a CUDA graph (replayed, they run as under
    ``mode="reduce-overhead"``, without the host's pace), or None where one cannot be captured
    (it reads a value back to the host, say)."""
    try:
        with torch.no_grad():
            return [capture_graph(fn, 1) for fn in fns]
    except RuntimeError as error:
        log.info("sparsecc: not captured in a CUDA graph (%s)", str(error).splitlines()[0] if str(error) else error)
        return None


def margin(raced: Raced) -> float:
    """The fraction of the dense program's time the rewritten one must stay within: :data:`MARGIN`,
    or :data:`HOST_BOUND_MARGIN` where the dense one is bound by the host."""
    return HOST_BOUND_MARGIN if raced.second_host_bound else MARGIN


def faster(raced: Raced) -> bool:
    """Whether the rewritten program (raced first) beats the dense one by its :func:`margin`, or,
    where the dense one is not bound by the host, in every one of at least :data:`ROUNDS` rounds,
    its slowest faster than the dense one's fastest. A margin on the whole program's time dilutes
    a real gain of its layers by the rest of the work: BERT-large (8 x 512 tokens) captured in a CUDA
    graph ran 25 ms a call on an H200, 7.9 eagerly, and there its 2:4 layers raced 1.4% faster,
    under the margin, while under Inductor they ran 3.5-5% faster. Rounds that do not overlap say the gain is larger
    than the rounds' spread (equal programs interleaved so land apart about once in 250 races);
    the host's pace varies more from the race to later calls than within it, so a host-bound race
    keeps asking its margin."""
    if raced.first_us <= margin(raced) * raced.second_us:
        return True
    return (not raced.second_host_bound and min(len(raced.first_rounds), len(raced.second_rounds)) >= ROUNDS
            and max(raced.first_rounds) < min(raced.second_rounds))


def all_dense(plan: Plan, raced: Raced, what: str = "graph") -> Plan:
    """``plan`` with every site dense, each reason saying the whole ``what`` was timed slower sparse."""
    bound = ", bound by the host" if raced.second_host_bound else ""
    why = (f"dense: this {what} with its sparse layers ran {raced.first_us:.0f} us per call on the example inputs, "
           f"the dense one {raced.second_us:.0f} us{bound} (a rewritten {what} must be "
           f"{1 - margin(raced):.0%} faster" + ("" if raced.second_host_bound else ", or in every round") + "); ")
    sites = [site if site.choice == "dense" else
             dataclasses.replace(site, choice="dense", reason=why + "the layer alone: " + site.reason,
                                 bytes_after=site.bytes_before, above=None)
             for site in plan.sites]
    return dataclasses.replace(plan, sites=sites)
