"""A linear site: one ``y = act(x @ W^T + b)`` found in a graph, with everything the
planner and the rewriter need to know about it.

Passes store a :class:`LinearSite` in ``node.meta[SITE_KEY]`` of the node that computes the
product (the *anchor*; once fuse_epilogue ran, the one node that computes the whole site). ``W`` is always the effective ``[N, K]`` weight (out, in features),
whatever form the graph used: ``nn.Linear``, ``F.linear``, ``addmm(b, x, W.t())``,
``x @ W.t()``, ``x @ P`` with a stored ``[K, N]`` matrix, or ``W @ x`` (the weight on the left,
which reads its input as ``[..., K, M]`` and writes ``[..., N, M]``). A quantized site (a call of
:func:`sparsecc.ir.quant.fp8_linear`) has an e4m3 ``W`` and also reads its scales' nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .epilogue import Activation, Epilogue

SITE_KEY = "sparsecc.site"


@dataclass
class LinearSite:
    name: str                         # unique in the model: module path + weight attribute
    weight_name: str                  # qualified name of the stored weight in its graph module
    weight: torch.Tensor              # effective [N, K] (may be a transposed view of storage)
    x: fx.Node                        # the input activation node
    anchor: fx.Node                   # the node computing the product
    weight_node: fx.Node | None = None   # the node yielding the stored weight (None: a module's)
    weight_transposed: bool = False      # the stored tensor is W^T ([K, N])
    bias_name: str | None = None
    bias: torch.Tensor | None = None     # [N]
    bias_node: fx.Node | None = None
    x_transposed: bool = False        # input is [..., K, M] (the W @ x form)
    transpose_out: bool = False       # output is stored [..., N, M]
    activation: Activation = Activation.NONE
    fused: list[str] = field(default_factory=list)        # the consumers it absorbed
    module_path: str = ""             # where its graph module sits in the model
    input_shape: tuple[int, ...] | None = None             # observed with the example inputs
    input_dtype: torch.dtype | None = None
    quantized: bool = False           # an FP8 site: W is e4m3, the scales follow
    weight_scale_node: fx.Node | None = None   # [N] fp32 per-channel scales
    input_scale_node: fx.Node | None = None    # a static input scale (None: per token)
    #: where ``x`` is its graph's input: the tensor the example run called the graph with, as
    #: (id, version), so that sites of different graphs called on one tensor are known to read
    #: the same input (sparsecc.ir.siblings); None: ``x`` says what it reads
    reads: tuple[int, int] | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def epilogue(self) -> Epilogue:
        return Epilogue(self.bias is not None, self.activation, self.transpose_out)

    @property
    def input_key(self) -> object:
        """What this site reads, comparable across graphs where it is a graph's input (``reads``)."""
        return self.x if self.reads is None else self.reads

    @property
    def m(self) -> int | None:
        """Rows of the product (tokens times batch) seen with the example inputs."""
        if self.input_shape is None:
            return None
        shape = self.input_shape
        if len(shape) == 1:
            return 1
        rows = 1
        for size in (shape[:-2] + shape[-1:]) if self.x_transposed else shape[:-1]:
            rows *= int(size)
        return rows


def sites_of(gm: fx.GraphModule) -> list[LinearSite]:
    """The sites marked in ``gm``, in graph order."""
    return [n.meta[SITE_KEY] for n in gm.graph.nodes if SITE_KEY in n.meta]
