"""``torch.compile(model, backend="sparsecc")``: the same passes, inside Dynamo.

Dynamo hands over each captured graph with the model's parameters as graph inputs (the
default ``inline_inbuilt_nn_modules``). The backend recognises them by their type, plans
and rewrites the sparse sites exactly as ``sparsecc.compile`` does, and hands the rewritten
graph to Inductor (or runs it as is, ``inductor=False``); a graph whose sites all stay dense (and
that has no patch convolution to run as a linear) goes to Inductor as Dynamo captured it. A graph
break or an op sparsecc does not know only means fewer sites: everything else runs as Inductor
would run it. A tensor-parallel layer (a DTensor weight: Dynamo sees the layer whole, its values
spread over ranks) is not a site here and runs as Inductor runs it; ``sparsecc.compile`` runs such
layers on their local shards, and its result can be handed to ``torch.compile`` in turn.

Each site is chosen by timing it alone; what Inductor does around the layers (its fusions,
its layouts, the host's pace op by op) is not in those timings. So where the graph can be run
again safely (real example inputs, no in-place op on them), the rewritten graph is timed against
the dense one Inductor would run, on the example inputs, and kept only if it is faster by
:data:`sparsecc.planner.check.MARGIN`; otherwise the dense graph runs and each site's reason in the plan says why.
This costs one more Inductor compile per graph; it is on by default on the GPU
(``make_backend(check_graph=...)``).

Packed weights are derived from the parameters they came from, so each call checks, per
packed weight, that its parameter is the same tensor with the same version counter: a weight
modified in place (an optimizer step, ``copy_``) or replaced makes the graph be planned,
packed and compiled again before it runs. A stale weight is never used.

Registered as ``sparsecc`` through the ``torch_dynamo_backends`` entry point (so
``backend="sparsecc"`` works without importing sparsecc) and with
``torch._dynamo.register_backend``. :func:`make_backend` builds one with options.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from .compiler import analyze_sites, mark_groups, pack_sites, plan_sites
from .errors import InputError
from .frontend.sharded import is_distributed
from .ir.formats import FormatSpec
from .ir.plan import Plan
from .ir.site import SITE_KEY
from .passes import conv_as_linear, find_linear, fuse_epilogue, splice
from .planner import check
from .planner.cost import CostModel
from .runtime.kernel_dir import use_kernels

log = logging.getLogger("sparsecc")


@dataclass
class SparseGraph:
    """A Dynamo graph with its sparse sites rewritten; rebuilt when a packed weight's source
    parameter changes. ``config_patches``: Inductor's options for it (its mode's and the user's)."""

    original: fx.GraphModule
    formats: list[FormatSpec] | None
    inductor: bool
    config_patches: dict
    cost_model: CostModel | None
    check_graph: bool = False
    plan: Plan | None = None
    #: the last check's timings (rewritten first, dense second); None where none ran
    raced: check.Raced | None = None
    rebuilds: int = 0
    _fn: object = None
    #: the dense graph compiled to race this one on its first call (None: no race pending)
    _rival: object = None
    #: the graph inputs holding packed weights' sources, and what each was when packed: (id,
    #: version, data pointer), checked on every call in one comprehension (112 weights: ~25 us
    #: of host time on a 2-core machine, against ~40 us one by one)
    _watched: list[int] = field(default_factory=list)
    _watched_as: list[tuple] = field(default_factory=list)

    @property
    def cuda_graphs(self) -> bool:
        """Whether Inductor replays this graph from CUDA graphs (``mode="reduce-overhead"``)."""
        return self.inductor and bool(self.config_patches.get("triton.cudagraphs"))

    def build(self, inputs: list) -> None:
        gm = _copy_of_dynamo_graph(self.original)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        constants = {node.target: (node.target, value) for node, value in zip(placeholders, inputs)
                     if isinstance(value, nn.Parameter)}
        index_of = {node.target: i for i, node in enumerate(placeholders)}
        converted = conv_as_linear.run(gm, placeholders=constants).changed
        _propagate(gm, inputs)
        sites = _local_sites(find_linear.run(gm, placeholders=constants).sites)
        fuse_epilogue.run(gm, placeholders=constants)
        device = next((v.device for v in inputs if isinstance(v, torch.Tensor)), torch.device("cpu"))
        cost_model = self.cost_model or CostModel(device, op_by_op=not self.cuda_graphs)
        stats = analyze_sites(sites, self.formats)
        self.plan = plan_sites(sites, stats, cost_model, self.formats, device)
        mark_groups(sites, stats, self.plan, cost_model)
        decisions = pack_sites(sites, stats, self.plan, cost_model)
        splice.run(gm, decisions)
        _name_sources(gm, self.original)
        self._watched = list(dict.fromkeys(index_of[s.weight_name] for s in sites
                                           if decisions.get(s.name) is not None and s.weight_name in index_of))
        self._watched_as = _states(inputs, self._watched)
        packed = any(d is not None for d in decisions.values())
        if self.inductor:
            from torch._inductor.compile_fx import compile_fx   # Inductor loads only when a graph uses it
            # with no site packed and no convolution run as a linear (a faster form), the graph Dynamo
            # captured, as it came: Inductor's own, not a rewrite computing the same (fused epilogues,
            # a Conv1D as a linear) that it may schedule otherwise
            rewritten = packed or converted
            self._fn = compile_fx(gm if rewritten else _dense_copy(self.original), list(inputs),
                                  config_patches=dict(self.config_patches))
            if self.check_graph and packed and check.can_run_again([self.original], inputs):
                try:
                    self._rival = compile_fx(_dense_copy(self.original), list(inputs),
                                             config_patches=dict(self.config_patches))
                except Exception as error:  # noqa: BLE001 - the check only refines the choice
                    _not_raced(error)
        else:
            self._fn = gm.forward

    def __call__(self, *args):
        if self._watched and _states(args, self._watched) != self._watched_as:
            log.info("a packed weight's parameter changed: planning and packing this graph again")
            self.rebuilds += 1
            self.build(list(args))
        if self._rival is not None:
            self._race(args)
        return self._fn(*args)

    def _race(self, args) -> None:
        """Time this graph against its dense rival on ``args`` and keep the faster (by
        check.MARGIN). It runs on the first call, as the user's calls run, not while Dynamo
        compiles: raced inside the compile, Llama-1B decode op by op on an H200 took 6679 us sparse
        against 8322 us dense, and then 4578 against 4345 us as the benchmark called the model
        (the cause inside the compile is not known): the race kept the slower graph."""
        dense, self._rival = self._rival, None
        try:
            raced = check.race(lambda: self._fn(*args), lambda: dense(*args),
                               cuda=any(isinstance(v, torch.Tensor) and v.is_cuda for v in args))
        except Exception as error:  # noqa: BLE001 - the check only refines the choice
            _not_raced(error)
            return
        self.raced = raced
        self.plan.checked = [round(raced.first_us, 1), round(raced.second_us, 1)]
        if not check.faster(raced):
            log.info("the graph with sparse layers ran %.0f us, the dense one %.0f us: dense kept",
                     raced.first_us, raced.second_us)
            self._fn, self._watched, self._watched_as = dense, [], []
            self.plan = check.all_dense(self.plan, raced)


def _not_raced(error: Exception) -> None:
    log.warning("sparsecc: the rewritten graph was not timed against the dense one (%s); it runs as planned",
                str(error).splitlines()[0] if str(error) else type(error).__name__)


def _states(args, indices: list[int]) -> list[tuple]:
    """What tells a packed weight's source changed, for ``args[i]`` of each of ``indices``: the
    tensor, its version (bumped by each in-place write) and where its data is."""
    return [(id(arg), arg._version, arg.data_ptr()) for arg in map(args.__getitem__, indices)]


def _local_sites(sites: list) -> list:
    """The sites whose weight is a plain tensor; a DTensor weight's site is unmarked (it stays the
    graph's own op), since each rank holds only a shard of it."""
    local = []
    for site in sites:
        if is_distributed(site.weight):
            del site.anchor.meta[SITE_KEY]
            log.info("%s is a tensor-parallel weight (DTensor): left to Inductor; sparsecc.compile runs such "
                     "layers on their local shards", site.name)
        else:
            local.append(site)
    return local


def _copy_of_dynamo_graph(original: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo graph to rewrite, keeping what Dynamo recorded for AOTAutograd: the
    graph's compile id and each input's source. From these AOTAutograd knows which inputs are
    parameters, and Inductor's CUDA graphs keep those in place instead of copying them into
    graph memory on every replay."""
    gm = fx.GraphModule(original, copy.deepcopy(original.graph))
    gm.meta.update(original.meta)
    sources = {n.name: n._dynamo_source for n in original.graph.nodes
               if n.op == "placeholder" and hasattr(n, "_dynamo_source")}
    for node in gm.graph.nodes:
        if node.name in sources:
            node._dynamo_source = sources[node.name]
    return gm


def _dense_copy(original: fx.GraphModule) -> fx.GraphModule:
    """The Dynamo graph as it came, for the race: a copy whose tensors all carry their sources
    (as the rewritten graph's do), so Inductor's CUDA graphs keep them in place for both graphs
    alike (without them, the dense graph copied its weights in on every replay)."""
    gm = _copy_of_dynamo_graph(original)
    _name_sources(gm, original)
    return gm


def _name_sources(gm: fx.GraphModule, original: fx.GraphModule) -> None:
    """Give each tensor the rewritten graph holds as an attribute (the packed weights) a source,
    as Dynamo does for the parameters it keeps as attributes: AOTAutograd lifts these into
    inputs and takes each for a constant input of the graph only if it has a source."""
    from torch._dynamo.source import ConstantSource     # Dynamo is loaded: a graph is being compiled
    if not hasattr(original, "_param_name_to_source"):
        return
    sources = dict(original._param_name_to_source)
    for name, _ in [*gm.named_parameters(), *gm.named_buffers()]:
        sources.setdefault(name, ConstantSource(f"sparsecc.{name}"))
    gm._param_name_to_source = sources


def _propagate(gm: fx.GraphModule, inputs: list) -> None:
    """Shapes for the passes (rank checks, observed M); fake or symbolic inputs are skipped."""
    if all(isinstance(v, (torch.Tensor, int, float, bool)) for v in inputs):
        try:
            with torch.no_grad():
                ShapeProp(gm).propagate(*inputs)
        except Exception as error:  # noqa: BLE001 - shapes only refine the plan
            log.debug("shape propagation skipped: %s", error)


#: the graphs compiled through the backend in this process, newest last (for inspection)
COMPILED: list[SparseGraph] = []


def make_backend(*, formats=None, inductor: bool = True, mode: str | None = None, options: dict | None = None,
                 cost_model: CostModel | None = None, kernels=None, check_graph: bool | None = None):
    """A Dynamo backend with options: ``formats`` restricts the candidates and ``kernels``
    names a generated kernel directory, as in ``sparsecc.compile``; ``inductor=False`` runs
    the rewritten graph without Inductor. ``mode`` and ``options`` are Inductor's, as
    ``torch.compile`` takes them (``torch.compile(model, backend="sparsecc", mode=...,
    options=...)`` passes them here too): ``mode="reduce-overhead"`` replays each graph from CUDA
    graphs, with the parameters and packed weights kept in place (only the activations are
    copied in per replay); ``options={"cpp_wrapper": True}`` has Inductor write the code that
    calls the graph's kernels in C++. ``check_graph``: time the rewritten graph against the dense
    one and keep the faster (module docstring; None: on the GPU, unless ``formats`` names only
    sparse formats)."""
    if kernels is not None:
        use_kernels(kernels)
    allowed = None if formats is None else [FormatSpec.parse(f) for f in ((formats,) if isinstance(formats, str) else formats)]
    defaults = _inductor_options(mode, options)

    def backend(gm: fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
        patches = {**defaults, **_inductor_options(mode, options)}
        on_gpu = any(isinstance(v, torch.Tensor) and v.is_cuda for v in example_inputs)
        forced = allowed is not None and not any(f.kind == "dense" for f in allowed)   # the user's explicit choice
        graph = SparseGraph(gm, allowed, inductor, patches, cost_model,
                            check_graph=(on_gpu and not forced) if check_graph is None else check_graph)
        graph.build(list(example_inputs))
        COMPILED.append(graph)
        return graph

    return backend


def _inductor_options(mode: str | None, options: dict | None) -> dict:
    """Inductor's config patches for a ``torch.compile`` mode plus explicit options."""
    patches = {}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options     # Inductor loads only when a mode is asked for
        known = list_mode_options()
        if mode not in known:
            raise InputError(f"mode={mode!r}: torch.compile's modes are {sorted(known)}")
        patches.update(list_mode_options(mode))
    return {**patches, **(options or {})}


sparsecc_backend = make_backend()


def register() -> None:
    """Register ``sparsecc`` with Dynamo by hand (the ``torch_dynamo_backends`` entry point of an
    installed sparsecc does this on its own, without importing sparsecc)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend   # Dynamo loads only here
    if "sparsecc" not in _COMPILER_FNS:      # not yet registered, by hand or by loading the entry point
        register_backend(compiler_fn=sparsecc_backend, name="sparsecc")
