"""Capture a model as fx graphs, as much of it as can be captured, shape-generic.

``torch.fx.symbolic_trace`` gives a graph that works for every input shape, but it fails on
models with data-dependent Python (Hugging Face models among them). When the whole model
cannot be traced, each child module is tried in turn, recursively: the parts that trace
become graphs, the rest stays Python and keeps calling them. Only modules that hold a
2-D weight (or a patch-embedding convolution, which sparsecc runs as a linear) somewhere are
visited. A module that cannot be traced and owns 2-D weights
directly (not through children) is reported, so the plan can say why they stay dense.

The example inputs are run once through the eager model first, both to check that they fit
it (a clear error if not) and to record what each module is called with. Modules the example
run does not call are not traced. A module's non-tensor arguments (``None``, flags, sizes)
are traced as the constants they were in that call (fx would otherwise take a ``None``
argument for a tensor and follow the wrong branch); such a part is wrapped in a
:class:`GuardedModule` that runs the original module whenever it is called with other
values. Shape propagation then annotates every graph with the recorded inputs.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import logging

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from ..errors import InputError
from ..passes.conv_as_linear import is_patch_conv
from .sharded import LocalShard

log = logging.getLogger("sparsecc")


@dataclass
class TracedPart:
    """One traced module: its path in the model ("" for the model itself), its graph, the
    arguments of its first call in the example run (by parameter name), and those of them
    that were traced as constants."""

    path: str
    gm: fx.GraphModule
    original: nn.Module
    arguments: dict[str, Any]
    constants: dict[str, Any]
    #: the LocalShard whose local linear this part is (it goes in there, not at ``path``)
    holder: LocalShard | None = None
    #: each tensor argument of that call as (id, version) when the module was called: parts
    #: called on one tensor, unchanged in between (an attention's q, k and v projections, which
    #: trace one by one where the attention does not), can share a call (sparsecc.ir.siblings)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def module(self) -> nn.Module:
        """What replaces the original module in the compiled model."""
        if not self.constants:
            return self.gm
        return GuardedModule(self.gm, self.original, self.constants)


class GuardedModule(nn.Module):
    """A traced module that was specialised to the constant (non-tensor) arguments it was
    traced with. Called with those, it runs the graph; called with anything else, it runs the
    original module (correct, at the original's speed) and says so once."""

    def __init__(self, compiled: fx.GraphModule, original: nn.Module, constants: dict[str, Any]):
        super().__init__()
        self.compiled = compiled
        self.original = original
        self.constants = constants
        self._signature = inspect.signature(original.forward)
        self._warned = False

    def forward(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        if all(_same(values[name], value) for name, value in self.constants.items()) and \
                all(isinstance(v, torch.Tensor) for n, v in values.items() if n not in self.constants):
            return self.compiled(*values.values())
        if not self._warned:
            log.warning("%s was called with other non-tensor arguments than in the example inputs "
                        "(traced with %s); running the original module", type(self.original).__name__,
                        self.constants)
            self._warned = True
        return self.original(*args, **kwargs)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


@dataclass
class Traced:
    parts: list[TracedPart]
    untraced: dict[str, str] = field(default_factory=dict)   # path -> why its own weights stay dense
    output: Any = None                                        # eager output on the example inputs


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """Accept a tensor, a tuple/list of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError("example_inputs must be a tensor, a tuple/list of positional arguments or "
                     f"a dict of keyword arguments, not {type(example_inputs).__name__}")


def trace(model: nn.Module, args: tuple, kwargs: dict) -> Traced:
    """Run ``model`` on the example inputs, then trace it (or its parts)."""
    output, calls = _run_recording_inputs(model, args, kwargs)
    traced = Traced(parts=[], output=output)
    _trace_module(model, "", calls, traced)
    for part in traced.parts:
        propagate_shapes(part)
    return traced


def _run_recording_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """The model's output on the example inputs, and each module's first call: its arguments and
    each tensor argument's version at that moment (by id)."""
    calls: dict[int, tuple[tuple, dict, dict[int, int]]] = {}

    def record(module, module_args, module_kwargs):
        if id(module) not in calls:
            tensors = [v for v in (*module_args, *module_kwargs.values()) if isinstance(v, torch.Tensor)]
            calls[id(module)] = (module_args, module_kwargs,      # (an inference tensor keeps no version)
                                 {id(t): t._version for t in tensors if not t.is_inference()})

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in model.modules()]
    try:
        with torch.no_grad():
            output = model(*args, **kwargs)
    except Exception as error:
        raise InputError(f"the example inputs do not fit the model: calling "
                         f"{type(model).__name__} with them raised {type(error).__name__}: {error}") from error
    finally:
        for handle in handles:
            handle.remove()
    return output, calls


def _holds_matrices(module: nn.Module) -> bool:
    """Whether ``module`` holds a 2-D weight, or a convolution sparsecc runs as a linear
    (passes/conv_as_linear: a patch embedding)."""
    return (any(p.dim() == 2 for p in module.parameters()) or any(b.dim() == 2 for b in module.buffers())
            or any(is_patch_conv(m) for m in module.modules()))


class _Tracer(fx.Tracer):
    """fx's tracer, keeping each :class:`LocalShard` (a tensor-parallel linear) as one call, so its
    hooks run (they convert to and from DTensors, which fx cannot trace)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, LocalShard) or super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(module: nn.Module, concrete_args) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(module, concrete_args)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _trace_module(module: nn.Module, path: str, calls: dict, traced: Traced,
                  holder: LocalShard | None = None) -> None:
    if not _holds_matrices(module):
        return
    if isinstance(module, LocalShard):      # its local linear is the part, named as the layer
        _trace_module(module.local, path, calls, traced, holder=module)
        return
    arguments = _bind(module, *calls[id(module)][:2]) if id(module) in calls else None
    try:
        if id(module) not in calls:
            raise TypeError("it is not called by the example run (a container, or unused)")
        if arguments is None:
            raise TypeError("its forward takes *args or **kwargs")
        constants = {name: value for name, value in arguments.items() if not isinstance(value, torch.Tensor)}
        gm = _symbolic_trace(module, constants or None)
    except Exception as error:  # fx raises many types; any failure means "try the children"
        own = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 2]
        if own:
            traced.untraced[path or "<model>"] = (f"{type(module).__name__} cannot be traced "
                                                  f"({type(error).__name__}: {str(error)[:160]}); "
                                                  f"its own weights {own} stay dense")
        for name, child in module.named_children():
            _trace_module(child, f"{path}.{name}" if path else name, calls, traced)
        return
    versions = calls[id(module)][2]
    seen = {name: (id(value), versions[id(value)]) for name, value in arguments.items() if id(value) in versions}
    traced.parts.append(TracedPart(path, gm, module, arguments, constants, holder, seen))
    _report_opaque_calls(gm, path, traced)
    for inner, shard in module.named_modules():
        if isinstance(shard, LocalShard) and shard is not module and shard is not holder:
            _trace_module(shard, f"{path}.{inner}" if path else inner, calls, traced)


def _report_opaque_calls(gm: fx.GraphModule, path: str, traced: Traced) -> None:
    """List in ``untraced`` the modules a graph calls whole (fx keeps torch.nn's modules as
    single calls) that hold 2-D weights sparsecc cannot see into, e.g. nn.MultiheadAttention:
    their weights stay dense, and the plan says so. Linear layers (sites) and embeddings (not
    linear) are left out."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, (nn.Linear, nn.Embedding, LocalShard)) or is_patch_conv(module):
            continue
        weights = [name for name, p in module.named_parameters() if p.dim() == 2]
        if weights:
            where = f"{path}.{node.target}" if path else str(node.target)
            traced.untraced[where] = (f"{type(module).__name__} is called as one torch module, which sparsecc "
                                      f"does not look into: its weights {weights} stay dense")


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by parameter name (defaults filled in); None for *args/**kwargs."""
    signature = inspect.signature(module.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return None
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def propagate_shapes(part: TracedPart) -> None:
    """Annotate ``part.gm`` with shapes and dtypes from the arguments it was called with."""
    with torch.no_grad():
        ShapeProp(part.gm).propagate(*part.arguments.values())


def assemble(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``model`` with the modules at the given paths replaced, sharing every
    parameter and untouched module with the original (which is left unchanged)."""
    if "" in replacements:
        return replacements[""]
    root = _shallow_copy(model)
    copies = {id(model): root}
    for path, new in replacements.items():
        *parents, last = path.split(".")
        parent = root
        for name in parents:
            child = parent._modules[name]
            if id(child) not in copies:
                copies[id(child)] = _shallow_copy(child)
                parent._modules[name] = copies[id(child)]
            parent = copies[id(child)]
        parent._modules[last] = new
    return root


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object whose registries (children, parameters, buffers, hooks) are its own
    dicts holding the same values, so replacing a child does not touch the original.

    Attributes that call the original module are left out: a method of it stored on the
    instance, or a wrapper of one, such as ``model.forward = torch.compile(model.forward)`` or
    the compiled ``__call__`` that Hugging Face's ``generate`` caches on a model
    (``_compiled_call``). Copied, they would run the original, uncompiled by sparsecc; left
    out, the copy runs its own forward (and ``generate`` compiles the copy's own call)."""
    new = copy.copy(module)
    for key, value in module.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
        elif _calls_into(value, module):
            del new.__dict__[key]
    return new


#: how many ``__wrapped__`` links :func:`_calls_into` follows
WRAPPER_DEPTH = 8


def _calls_into(value: Any, module: nn.Module) -> bool:
    """Whether ``value`` is a method bound to ``module``, or wraps one (``functools.wraps``'
    ``__wrapped__``, which torch.compile sets)."""
    for _ in range(WRAPPER_DEPTH):
        if value is None or isinstance(value, (torch.Tensor, nn.Module)):
            return False
        if getattr(value, "__self__", None) is module:
            return True
        value = getattr(value, "__wrapped__", None)
    return False
