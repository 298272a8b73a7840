"""Sibling sites priced together.

Sites that read the same input (an attention's q, k and v; an MLP's gate and up) run as one call
when they are planned in the same sparse format (:mod:`sparsecc.ir.siblings`). Planned one by one,
each is weighed with a launch of its own and, op by op, a host call of its own: at a few rows a
small product is mostly that fixed cost, which a shared call pays once. A layer whose sparse kernel
alone only breaks even (a 512-row k or v projection at one token) may well pay in the group.

So, where the cost model times its candidates on the GPU, each set of such sites that was not
planned in one sparse format already is planned once more as one site, their weights stacked, at
the rows they were planned for. Where the stacked weight's fastest timed sparse format beats the
members' timed choices added up by the timing margin, every member takes that format and the set
runs as one call. Op by op (sparse times then include their host time beyond one dense call's)
the stacked call is also credited the dense calls it saves: k dense layers are k host calls, the
group one. Sites planned over a batch range are left as planned (their choices may differ bucket
by bucket), as is a set of which some already share a call.
"""
from __future__ import annotations

from ..ir import siblings
from ..ir.formats import DENSE, FormatSpec
from ..ir.plan import Plan, SitePlan
from .cost import DEFAULT_M, MEASURED_MARGIN, CostModel


def price_together(sites, stats, plan: Plan, cost_model: CostModel, allowed) -> None:
    """Give each set of sibling sites the stacked weight's fastest timed sparse format where one
    call of it beats the members as planned (see the module docstring); updates ``plan``."""
    if not cost_model.prices_groups():
        return
    for members in siblings.readers(sites):
        entries = [plan[member.name] for member in members]
        if any(entry.m_range or entry.above for entry in entries) or _shares_a_call(entries):
            continue
        alone = [_timed(entry.candidates, entry.choice) for entry in entries]
        if None in alone:
            continue
        # the stacked weight to plan (its format is what is being chosen: none yet)
        group = siblings.SiblingGroup(members, DENSE, siblings.stacked([stats[m.name] for m in members]))
        site = group.site()
        decision = cost_model.decide(group.stats, members[0].m, allowed,
                                     measure_sites=cost_model.site_timer(site.weight, group.stats, site.epilogue))
        timed = {FormatSpec.parse(c.format): c.measured_us for c in decision.candidates if c.measured_us is not None}
        sparse = [spec for spec in timed if spec.kind != "dense" and all(stats[m.name].fits(spec) for m in members)]
        if not sparse:
            continue
        choice = min(sparse, key=timed.get)
        together = timed[choice]
        saved = (len(members) - 1) * cost_model.dense_host_us(site.weight, members[0].m or DEFAULT_M) \
            if cost_model.charges_host() else 0.0
        if together - saved > MEASURED_MARGIN["cuda"] * sum(alone):
            continue
        n, k = group.stats.shape
        host = (f" (op by op one host call where dense makes {len(members)}: {saved:.1f} us less)"
                if saved else "")
        why = (f"{choice} with its siblings, in one call ({group.name}): their stacked {n}x{k} weight was timed "
               f"{together:.1f} us as {choice}{host}, the {len(members)} as planned alone {sum(alone):.1f} us")
        for entry in entries:
            _take(entry, choice, f"{why}; alone: {entry.reason}")


def _timed(candidates, choice: str) -> float | None:
    """The measured time of ``choice`` among a plan entry's or a decision's candidates, or None
    where it was only predicted (a timing is only weighed against timings)."""
    for candidate in candidates:
        if candidate.format == choice:
            return candidate.measured_us
    return None


def _shares_a_call(entries: list[SitePlan]) -> bool:
    """Whether two of ``entries`` were planned in the same sparse format (they share a call already)."""
    sparse = [entry.choice for entry in entries if FormatSpec.parse(entry.choice).kind != "dense"]
    return len(sparse) != len(set(sparse))


def _take(entry: SitePlan, choice: FormatSpec, reason: str) -> None:
    """``entry`` planned as ``choice``: its bytes are its own candidate's until packing shares the group's."""
    entry.choice, entry.reason, entry.above = str(choice), reason, None
    entry.bytes_after = next((c.nbytes for c in entry.candidates if c.format == str(choice)), entry.bytes_before)

