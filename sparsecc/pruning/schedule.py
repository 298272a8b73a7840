"""Gradual pruning: reach a density in steps while fine-tuning, not in one cut.

Zhu & Gupta (2017) raise the sparsity along a cubic: after step t of T,

    s_t = s_f + (s_i - s_f) * (1 - t / T) ** 3

fast at first, while many redundant weights remain, then slowly, so training can recover
between cuts. In densities (d = 1 - s) the formula is the same. :class:`GradualPruning` is a
small object the training loop steps::

    schedule = GradualPruning(model, "unstructured@0.02", steps=10, scope="erk")
    handle = attach_to_optimizer(model, optimizer)   # masks held between schedule steps
    for i, batch in enumerate(loader):
        ...loss.backward(); optimizer.step()
        if i % 50 == 0 and not schedule.done:
            schedule.step()                          # re-prune at the next density
    remove_masks(model, handle)

Each step calls :func:`sparsecc.pruning.prune` with ``keep_masks=True`` at the step's
density (the other keyword arguments are passed through, e.g. ``scope``, ``criterion``,
``calibration``, ``exclude``). Weights pruned earlier are zero, so they score lowest and stay
pruned: the masks only shrink. Only density patterns (``unstructured``, ``block``) can be
scheduled; N:M patterns have no density to interpolate.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from ..errors import InputError
from .apply import prune
from .patterns import Pattern, parse_pattern
from .report import PruneReport


class GradualPruning:
    """Prune ``model`` to ``pattern``'s density over ``steps`` calls of :meth:`step`.

    Args:
        pattern: a density pattern (``"unstructured@0.02"``, ``"block8x8@0.1"``): its density
            is the final one.
        steps: how many calls of :meth:`step` reach the final density (T).
        initial_density: the density the schedule starts from (1 - s_i), 1.0 by default.
        prune_kwargs: passed to :func:`sparsecc.pruning.prune` at every step; a
            ``calibration`` for ``criterion="wanda"`` is run at every step, so it must be a
            re-iterable collection (a list, a DataLoader), not a one-shot iterator.
    """

    def __init__(self, model: nn.Module, pattern: "str | Pattern", *, steps: int,
                 initial_density: float = 1.0, **prune_kwargs):
        self.model = model
        self.pattern = parse_pattern(pattern)
        if not self.pattern.SUPPORTS_GLOBAL_SCOPE:
            raise InputError(f"gradual pruning interpolates a density; {self.pattern} has none: "
                             "use 'unstructured@<d>' or 'block<h>x<w>@<d>', or prune it in one step")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise InputError(f"steps must be an integer >= 1, got {steps!r}")
        if not isinstance(initial_density, (int, float)) or \
                not self.pattern.density <= initial_density <= 1.0:
            raise InputError(f"initial_density must be between the final density "
                             f"{self.pattern.density} and 1, got {initial_density!r}")
        if "keep_masks" in prune_kwargs:
            raise InputError("GradualPruning always keeps the masks (keep_masks=True); drop it")
        if isinstance(prune_kwargs.get("calibration"), Iterator):
            raise InputError("calibration is run at every step, so it must be re-iterable (a "
                             "list or a DataLoader), not a one-shot iterator or generator")
        self.steps = steps
        self.initial_density = float(initial_density)
        self.prune_kwargs = prune_kwargs
        self.step_count = 0
        self.reports: list[PruneReport] = []

    def density_at(self, step: int) -> float:
        """The target density after ``step`` steps (the cubic schedule; final from T on)."""
        progress = min(max(step, 0), self.steps) / self.steps
        final = self.pattern.density
        return final + (self.initial_density - final) * (1.0 - progress) ** 3

    @property
    def done(self) -> bool:
        """Whether the final density has been reached."""
        return self.step_count >= self.steps

    def step(self) -> PruneReport:
        """Prune to the next density of the schedule and return that prune's report. After
        the last step, a further call re-applies the final density."""
        self.step_count = min(self.step_count + 1, self.steps)
        pattern = replace(self.pattern, density=self.density_at(self.step_count))
        report = prune(self.model, pattern, keep_masks=True, **self.prune_kwargs)
        self.reports.append(report)
        return report
