"""Make a model sparse before compiling it (the lossy step, kept apart from ``compile``).

    report = sparsecc.pruning.prune(model, "2:4", exclude="lm_head")
    print(report.table())

Patterns: any ``n:m`` (1 <= n < m, found in O(numel), no permutation search), vector-wise
``n:m/vw<v>`` and block-wise ``n:m/bw<b>`` N:M, ``block<h>x<w>@<density>`` and
``unstructured@<density>`` (per layer, ``scope="global"`` or ``scope="erk"``). The criterion
is magnitude, ``criterion="wanda"`` (|w| times its input's norm on ``calibration=`` batches)
or a callable. Fine-tuning keeps the pattern exact::

    prune(model, "2:4", keep_masks=True)
    handle = attach_to_optimizer(model, optimizer)    # masks re-applied after every step
    ...train...
    remove_masks(model, handle)                       # plain, exactly sparse weights

:class:`GradualPruning` reaches a density in steps while fine-tuning (cubic schedule).

Modules: ``patterns`` (parsing, config objects), ``masks`` (pure mask functions),
``selection`` (which layers), ``apply`` (prune), ``report``, ``finetune``, ``criteria``,
``calibration`` and ``wanda`` (activation-aware scores), ``allocation`` (``scope="erk"``),
``schedule`` (gradual pruning).
"""
from .apply import prune
from .finetune import attach_to_optimizer, remove_masks
from .masks import pattern_mask
from .patterns import (BlockNMPattern, BlockPattern, NMPattern, Pattern, UnstructuredPattern,
                       VectorNMPattern, parse_pattern)
from .report import LayerReport, PruneReport
from .schedule import GradualPruning

__all__ = ["prune", "parse_pattern", "pattern_mask", "Pattern", "NMPattern", "VectorNMPattern",
           "BlockNMPattern", "BlockPattern", "UnstructuredPattern", "PruneReport", "LayerReport",
           "attach_to_optimizer", "remove_masks", "GradualPruning"]
