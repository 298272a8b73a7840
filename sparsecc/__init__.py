"""sparsecc: a compiler that makes sparse PyTorch models fast.

    model = sparsecc.compile(model, example_inputs)     # eager module in, module out
    plan = sparsecc.plan(model, example_inputs)         # what compile would do, and why
    sparsecc.prune(model, "2:4")                        # make a model sparse first (lossy)
"""
__version__ = "0.1.0"

from . import gpu, ops  # noqa: F401  (register the sparsecc:: custom ops)
from .compiler import compile, plan
from .cost import CostModel
from .errors import (FormatError, InputError, KernelBuildError, PatternError, PlanError,
                     SparseccError, TraceError)
from .formats import FormatSpec, pack
from .plan import Plan
from .pruning import prune
from . import backend as _backend

_backend.register()

__all__ = ["compile", "plan", "prune", "Plan", "CostModel", "FormatSpec", "pack", "SparseccError", "InputError",
           "TraceError", "FormatError", "PatternError", "PlanError", "KernelBuildError", "__version__"]
