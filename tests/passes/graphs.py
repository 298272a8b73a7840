"""Helpers for graph-level pass tests: trace a module with shapes, and describe a graph as
a list of (op, target) so a test can compare Before/Expected."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp


def traced(module: torch.nn.Module, *example) -> fx.GraphModule:
    gm = fx.symbolic_trace(module)
    ShapeProp(gm).propagate(*example)
    return gm


def ops(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The graph's computation as (op, target) pairs; constants read with get_attr are kept."""
    out = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        out.append((node.op, str(target)))
    return out
