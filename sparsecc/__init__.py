"""sparsecc: a compiler that makes sparse PyTorch models fast.

    model = sparsecc.compile(model, example_inputs)     # eager module in, module out
    plan = sparsecc.plan(model, example_inputs)         # what compile would do, and why
    sparsecc.prune(model, "2:4")                        # make a model sparse first (lossy)
    sparsecc.quantize(model, "fp8")                     # FP8 weights and inputs (lossy)
    sparsecc.use_grouped_attention(model)               # decode steps read each key/value head once

``torch.compile(model, backend="sparsecc")`` finds the backend through the package's entry point.
"""
from ._version import __version__
from .compiler import compile, plan
from .errors import (FormatError, InputError, KernelBuildError, PatternError, PlanError,
                     SparseccError, TraceError)
from .grouped_attention import use_grouped_attention
from .ir.formats import FormatSpec, pack
from .ir.plan import Plan
from .planner.cost import CostModel
from .pruning import prune
from .quantization import quantize

__all__ = ["compile", "plan", "prune", "quantize", "use_grouped_attention", "Plan", "CostModel", "FormatSpec", "pack", "SparseccError", "InputError",
           "TraceError", "FormatError", "PatternError", "PlanError", "KernelBuildError", "__version__"]
