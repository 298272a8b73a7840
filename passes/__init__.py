"""Graph rewrites, one pass per module; installed as ``sparsecc.passes``.

Each pass is a module with one public function ``run(gm, ...) -> PassResult``; its
docstring says what the pass requires of the graph and what it ensures.

Order: :mod:`.find_linear` -> :mod:`.fuse_epilogue` -> (planning) -> :mod:`.splice`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from sparsecc.ir.site import LinearSite


@dataclass
class PassResult:
    gm: fx.GraphModule
    changed: bool
    sites: list[LinearSite] = field(default_factory=list)
