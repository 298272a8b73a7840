"""One plan for every rank of a tensor-parallel model.

Each rank of a model sharded with ``parallelize_module`` compiles its own shards, but the ranks
must run the same format per layer: a rank whose layer fell back to dense would still be in step
(the collectives sit outside the layers), yet ranks that plan on their own may time and choose
differently, and a replayed plan must fit every rank's shard. So ``sparsecc.compile`` of a sharded
model, on every rank of the default process group at once:

1. analyses its own shards and gathers every rank's statistics (``all_gather_object``);
2. merges them per layer into the worst case (:func:`sparsecc.ir.analysis.worst_of`: a format
   fits only if it fits every rank's shard, and the densest shard is priced);
3. rank 0 plans from the merged statistics and broadcasts the plan's JSON
   (``broadcast_object_list``); every rank replays it on its own shards.

A rank that fails to plan sends the error instead, so the others raise it rather than wait.
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from ..errors import PlanError
from ..frontend.sharded import ShardLayout
from ..ir.analysis import WeightStats, worst_of
from ..ir.formats import FormatSpec
from ..ir.plan import Plan

#: the object rank 0 broadcasts in place of a plan when planning failed there
_FAILED = "sparsecc: planning failed on rank 0: "


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def merged_stats(stats: dict[str, WeightStats]) -> dict[str, WeightStats]:
    """Every rank's statistics per site, merged into the worst case (a collective: every rank
    calls it with the same sites)."""
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, stats)
    names = [sorted(g) for g in gathered]
    if any(n != names[0] for n in names):
        raise PlanError("the ranks found different linear sites in the model (is it the same model, sharded the "
                        "same way, with the same example inputs on every rank?)")
    return {name: worst_of([g[name] for g in gathered]) for name in stats}


def broadcast_plan(make: Callable[[], Plan]) -> Plan:
    """The plan rank 0 makes with ``make()``, on every rank (a collective)."""
    box: list = [None]
    error = None
    if rank() == 0:
        try:
            box[0] = make().to_json()
        except Exception as raised:  # noqa: BLE001 - sent to the other ranks, then raised here
            error = raised
            box[0] = _FAILED + f"{type(raised).__name__}: {raised}"
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0].startswith(_FAILED):
        raise PlanError(box[0])
    return Plan.from_json(box[0])


def shard_note(layout: ShardLayout, formats: list[FormatSpec]) -> str:
    """What a plan says about a sharded site: where its shard lies, and whether the shard's
    boundaries cut the groups along K or the blocks of ``formats`` in the full weight (the shard
    is analysed on its own, so its fit can differ from the full weight's)."""
    note = layout.describe()
    cut = []
    for spec in dict.fromkeys(formats):
        if spec.kind == "nm" and layout.cuts(group_along_k=spec.m):
            cut.append(f"groups of {spec.m} along K ({spec})")
        elif spec.kind == "bsr" and spec.block and layout.cuts(block=spec.block):
            cut.append(f"{spec.block[0]}x{spec.block[1]} blocks ({spec})")
    if cut:
        note += (f"; its boundary falls inside {' and '.join(cut)} of the full weight: the shard's own groups and "
                 "blocks were analysed, which may fit where the full weight's do not, or not fit where they do")
    return note
