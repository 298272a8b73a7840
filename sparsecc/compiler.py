"""``sparsecc.compile`` and ``sparsecc.plan``: the pipeline of docs/design.md, end to end.

trace (fx, part by part if needed) -> conv_as_linear -> find_linear -> fuse_epilogue -> analysis -> cost model
(or a given plan) -> pack -> splice -> a module that computes what the model computed.

A tensor-parallel model (linears sharded by ``parallelize_module``) runs each rank's local shards
(sparsecc.frontend.sharded), planned once for all ranks (sparsecc.planner.shared).
"""
from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from tqdm.auto import tqdm
from torch.utils import _pytree as pytree

from .config import settings
from .errors import InputError, KernelBuildError, PlanError, SparseccError
from .frontend import sharded, tracing
from .frontend.shared_globals import share_globals
from .ir.analysis import WeightStats, analyze
from .ir import siblings
from .ir.formats import NM_2_4, FormatSpec, pack
from .ir.mutation import writes_before
from .ir.numerics import relative_error
from .ir.plan import ABOVE_DENSE, Candidate, Plan, SitePlan
from .ir.site import LinearSite
from .kernels import registry, tune
from .passes import conv_as_linear, find_linear, fuse_epilogue, splice
from .planner import check, shared
from .planner.cost import DEFAULT_M, QUANTIZED_KINDS, CostModel, check_m_range
from .planner.groups import price_together
from .runtime.kernel_dir import use_kernels
from .runtime.shared_call import SharedCall

log = logging.getLogger("sparsecc")

#: planning shows a progress bar from this many sites
PROGRESS_MIN_SITES = 8
#: relative error (norm of the difference over norm of the reference) allowed when a
#: compiled model is checked against the eager one, by output dtype
VERIFY_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class _Prepared:
    model: nn.Module
    args: tuple
    kwargs: dict
    traced: tracing.Traced
    sites: list[LinearSite]
    stats: dict[str, WeightStats]
    plan: Plan
    cost_model: CostModel
    #: paths of the parts in which conv_as_linear rewrote a convolution
    converted: set[str]


def plan(model: nn.Module, example_inputs, *, formats=None, device=None,
         cost_model: CostModel | None = None, m_range=None, objective: str = "latency") -> Plan:
    """Decide, per linear site, which exact format runs it, without changing the model
    (arguments as in :func:`compile`)."""
    tuned_before = len(tune.LOG)
    the_plan = _prepare(model, example_inputs, formats, device, cost_model, given_plan=None,
                        m_range=m_range, objective=objective).plan
    the_plan.tuning = tune.log_since(tuned_before)
    return the_plan


def compile(model: nn.Module, example_inputs, *, formats=None, plan: Plan | str | None = None,
            device=None, cost_model: CostModel | None = None, verify: bool = True,
            kernels=None, m_range=None, objective: str = "latency", check_graph: bool | None = None) -> nn.Module:
    """Return a module that computes what ``model`` computes, with its sparse linear layers
    running in the formats the plan chose.

    Args:
        model: any ``nn.Module``; it is not modified (the result shares its untouched parts,
            and the modules whose linear layers all stay dense: they run as they are).
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword
            arguments, as the model is called; they set the batch size M the plan targets.
        formats: restrict the candidates, e.g. ``("2:4",)``: each site uses one of these
            wherever its weight fits exactly, dense elsewhere. ``None``: the cost model picks.
        plan: a :class:`Plan` (or its JSON) to replay instead of planning.
        device: where the compiled model runs (default: where the model's parameters are);
            a model elsewhere is copied there.
        cost_model: a custom cost model (its own objective applies).
        m_range: ``(lo, hi)``, the batch sizes M the model will run at (e.g. ``(1, 8192)``
            for decode and prefill); each site is chosen for the whole range, bucket by
            bucket (see sparsecc.planner.cost). Default: the M of the example inputs; for a
            model that generates (a Hugging Face causal LM, see :func:`generates`), from the
            batch (the example's first dimension) to that M: give it the prompts (batch x
            prompt length tokens, the prefill) and the plan covers decoding too (one token per
            sequence, M = batch).
        objective: ``"latency"`` (the fastest) or ``"memory"`` (the fewest bytes among the
            formats predicted within 10% of the fastest).
        verify: run the compiled model on the example inputs and raise if it does not match
            the eager model within :data:`VERIFY_TOLERANCE` (skipped in training mode).
        kernels: a directory made by ``sparsecc generate``: its kernels are loaded (checked
            against their hashes) instead of compiled, so no CUDA compiler is needed.
        check_graph: time the compiled model against ``model`` on the example inputs (on the
            GPU each replayed from a CUDA graph, as the sites were timed; a model that cannot be
            captured is not checked) and return the compiled one only if it is faster by 2%, else
            ``model``'s dense layers with every site's reason saying why (sparsecc.planner.check).
            None: on the GPU, for a plan made here at one batch size (not for a batch range, which
            the example inputs time only the top of) with dense among the formats. Never for a
            model whose traced graphs write in place or that could not be traced whole, nor in
            training mode.

    The result has the plan as ``result.sparsecc_plan``.
    """
    given = Plan.from_json(plan) if isinstance(plan, str) else plan
    if kernels is not None:
        use_kernels(kernels)
    tuned_before = len(tune.LOG)
    prepared = _prepare(model, example_inputs, formats, device, cost_model, given_plan=given,
                        m_range=m_range, objective=objective)
    decisions = pack_sites(prepared.sites, prepared.stats, prepared.plan, prepared.cost_model)
    prepared.plan.tuning = tune.log_since(tuned_before)
    replaced, spliced = {}, []
    for part in prepared.traced.parts:
        sites = [s for s in prepared.sites if s.module_path == part.path]
        if not sites or _computes_as_written(part, sites, decisions, prepared.converted):
            continue
        splice.run(part.gm, {s.name: decisions[s.name] for s in sites})
        spliced += [part.gm, *(m.compute for m in part.gm.modules() if isinstance(m, SharedCall))]
        if part.holder is not None:          # a tensor-parallel layer's local shard
            part.holder.local = part.module()
        else:
            replaced[part.path] = part.module()
    share_globals(dict.fromkeys(spliced))          # a shared call's module is in several parts
    compiled = tracing.assemble(prepared.model, replaced)
    compiled.sparsecc_plan = prepared.plan
    sources = PackedSources(prepared.model, prepared.sites, decisions)
    if sources.watched:                      # nothing packed: no check to run before each call
        compiled.register_forward_pre_hook(sources)
    if verify:
        _verify(compiled, prepared)
    if _checks_whole(check_graph, prepared, decisions, given, formats):
        compiled = _dense_unless_faster(compiled, prepared)
    return compiled


def _checks_whole(asked: bool | None, prepared: _Prepared, decisions: dict, given, formats) -> bool:
    """Whether compile times the compiled model against the dense one (``check_graph``)."""
    if (asked is False or prepared.model.training or all(d is None for d in decisions.values())
            or prepared.plan.untraced or any(part.holder is not None for part in prepared.traced.parts)):
        return False
    if not asked:
        allowed = _parse_formats(formats)
        ranged = any(s.m_range and s.m_range[0] != s.m_range[1] for s in prepared.plan.sites)
        dense_allowed = allowed is None or any(f.kind == "dense" for f in allowed)
        if not (prepared.plan.device.startswith("cuda") and given is None and not ranged and dense_allowed):
            return False
    inputs = [v for v in pytree.tree_leaves((prepared.args, prepared.kwargs)) if v is not None]
    return check.can_run_again([part.gm for part in prepared.traced.parts], inputs)


def _dense_unless_faster(compiled: nn.Module, prepared: _Prepared) -> nn.Module:
    """``compiled`` if it beats the dense model on the example inputs, else the dense model (a
    shallow copy sharing its modules) whose plan says every site is dense, and why."""
    args, kwargs = prepared.args, prepared.kwargs
    model = prepared.model
    runners = [lambda: compiled(*args, **kwargs), lambda: model(*args, **kwargs)]
    cuda = prepared.plan.device.startswith("cuda")
    if cuda:        # timed as the per-site choices were: replayed from CUDA graphs
        graphs = check.captured(*runners)
        if graphs is None:
            log.info("sparsecc: the model cannot be captured in a CUDA graph: its plan is not checked as a whole")
            return compiled
        runners = [graph.replay for graph in graphs]
    raced = check.race(*runners, cuda=cuda)
    prepared.plan.checked = [round(raced.first_us, 1), round(raced.second_us, 1)]
    if check.faster(raced):
        log.info("sparsecc: the compiled model ran %.0f us per call, the dense one %.0f us: kept",
                 raced.first_us, raced.second_us)
        return compiled
    log.info("sparsecc: the compiled model ran %.0f us per call, the dense one %.0f us: its layers stay dense",
             raced.first_us, raced.second_us)
    dense = tracing.assemble(model, {})
    dense.sparsecc_plan = check.all_dense(prepared.plan, raced, what="model")
    return dense


def _computes_as_written(part: tracing.TracedPart, sites: list[LinearSite], decisions: dict,
                         converted: set[str]) -> bool:
    """Whether ``part``'s graph would compute just what its module computes, so the module is kept
    as it is: every site in it stays dense and in full precision (splice makes such a site
    ``F.linear`` plus the epilogue it fused: the module's own math) and conv_as_linear rewrote no
    convolution in it (a faster form). Such a graph would only add host time to every call: one
    more GraphModule (or GuardedModule) for Python to run and ``torch.compile`` to guard on, per
    part (each ``nn.Linear`` of a Hugging Face Llama is one). A part with an FP8 site is replaced:
    the site runs as its ``sparsecc::linear_fp8`` node."""
    return part.path not in converted and all(decisions[s.name] is None and not s.quantized for s in sites)


def _prepare(model, example_inputs, formats, device, cost_model, given_plan, m_range=None,
             objective="latency") -> _Prepared:
    if not isinstance(model, nn.Module):
        raise InputError(f"sparsecc needs an nn.Module, got {type(model).__name__}")
    allowed = _parse_formats(formats)
    if any(p.is_meta for p in model.parameters()):
        raise InputError("the model has parameters on the meta device (no values): load its weights first, "
                         "e.g. model.to_empty(device=...) then load_state_dict(...)")
    target = _target_device(model, device)
    shards, refused = sharded.find_shards(model)
    if any(p.device != target for p in model.parameters()):
        if shards or refused:
            raise InputError(f"the tensor-parallel model is not on {target}: move it there before sharding it")
        model = copy.deepcopy(model).to(target)
    if shards:
        model = tracing.assemble(model, shards)
    args, kwargs = tracing.normalize_inputs(example_inputs)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (args, kwargs))
    traced = tracing.trace(model, args, kwargs)
    sites: list[LinearSite] = []
    converted = set()
    for part in traced.parts:
        if conv_as_linear.run(part.gm).changed:
            tracing.propagate_shapes(part)            # the new nodes' shapes (each site's M)
            converted.add(part.path)
        sites += _with_inputs_seen(find_linear.run(part.gm, prefix=part.path).sites, part)
        fuse_epilogue.run(part.gm)
    stats = analyze_sites(sites, allowed)
    m_range = check_m_range(m_range)
    seen = [s.m for s in sites if s.m]
    if m_range is None and seen and generates(model):
        m_range = (min(_batch_of(args, kwargs), max(seen)), max(seen))
    model_cost = cost_model or CostModel(target, objective=objective)
    untraced = {**refused, **traced.untraced}
    layouts = {s.name: shards[s.module_path].layout for s in sites if s.module_path in shards}
    if given_plan is not None:
        the_plan = _replay(given_plan, sites, stats, target, untraced)
    elif layouts and shared.world_size() > 1:
        merged = shared.merged_stats(stats)
        rank0 = shared.broadcast_plan(lambda: plan_sites(sites, merged, model_cost, allowed, target, untraced,
                                                         m_range))
        the_plan = _replay(rank0, sites, stats, target, untraced,
                           how=f"planned on rank 0 for the shards of all {shared.world_size()} ranks")
    else:
        the_plan = plan_sites(sites, stats, model_cost, allowed, target, untraced, m_range)
    for name, layout in layouts.items():
        the_plan[name].reason += "; " + shared.shard_note(layout, [FormatSpec.parse(the_plan[name].choice),
                                                                  *(allowed or ())])
    mark_groups(sites, stats, the_plan, model_cost)
    return _Prepared(model, args, kwargs, traced, sites, stats, the_plan, model_cost, converted)


def _with_inputs_seen(sites: list[LinearSite], part: tracing.TracedPart) -> list[LinearSite]:
    """``sites``, each that reads its graph's input knowing which tensor the example run gave it
    (``LinearSite.reads``): a module that does not trace whole leaves its layers one graph each,
    and those called on one tensor can still share a call."""
    placeholders = [node for node in part.gm.graph.nodes if node.op == "placeholder"]
    names = dict(zip(placeholders, part.arguments))
    writes = writes_before(part.gm.graph)
    for site in sites:       # (a write in place before the site in its graph: the call's tensor changed)
        if site.x in names and names[site.x] in part.seen and not writes[site.anchor]:
            site.reads = part.seen[names[site.x]]
    return sites


def generates(model: nn.Module) -> bool:
    """Whether ``model`` generates text token by token: it has a ``generate`` method and, where
    it says (Hugging Face's ``can_generate()``: a causal-LM head), can use it. Such a model runs
    its linear layers at M = batch x prompt length for the prompt and at M = batch per new
    token, so its plan covers both by default."""
    if not callable(getattr(model, "generate", None)):
        return False
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else True


def _batch_of(args, kwargs) -> int:
    """The batch of a causal LM's example: the first dimension of its token ids (1 if unbatched)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 1


def _parse_formats(formats) -> list[FormatSpec] | None:
    if formats is None:
        return None
    if isinstance(formats, (str, FormatSpec)):
        formats = (formats,)
    specs = [FormatSpec.parse(f) for f in formats]
    if not specs:
        raise InputError("formats=() allows nothing; pass None to let the cost model choose")
    return specs


def _target_device(model: nn.Module, device) -> torch.device:
    if device is not None:
        target = torch.device(device)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise InputError("device='cuda' was asked for, but torch sees no CUDA device")
        return target
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def analyze_sites(sites: list[LinearSite], allowed) -> dict[str, WeightStats]:
    """Measure each site's weight once (sites sharing a weight share the result)."""
    groups = tuple(s.m for s in allowed or () if s.kind == "nm")
    blocks = tuple(s.block for s in allowed or () if s.kind == "bsr" and s.block)
    by_weight: dict[tuple, WeightStats] = {}
    stats = {}
    for site in sites:
        key = (site.module_path, site.weight_name, site.weight_transposed)
        if key not in by_weight:
            by_weight[key] = analyze(site.weight, extra_group_sizes=groups, extra_blocks=blocks)
        stats[site.name] = by_weight[key]
    return stats


def plan_sites(sites, stats, cost_model: CostModel, allowed, device, untraced=None, m_range=None) -> Plan:
    """The cost model's decision for every site (over ``m_range`` if given), with a progress bar
    where there are many; sibling sites priced together too (sparsecc.planner.groups)."""
    progress = tqdm(sites, desc="sparsecc: planning", unit="site", disable=len(sites) < PROGRESS_MIN_SITES,
                    leave=False)
    plan = Plan([_plan_site(s, stats[s.name], cost_model, allowed, m_range) for s in progress], device=str(device),
                untraced=untraced or {})
    price_together(sites, stats, plan, cost_model, allowed)
    return plan


def _plan_site(site: LinearSite, stats: WeightStats, cost_model: CostModel, allowed, m_range) -> SitePlan:
    decision = cost_model.decide(stats, site.m, allowed, m_range=m_range,
                                 measure_sites=cost_model.site_timer(site.weight, stats, site.epilogue))
    return _site_plan(site, stats, decision.choice, decision.reason,
                      [Candidate(p.format, round(p.us, 3), p.nbytes, p.measured_us) for p in decision.candidates],
                      decision.buckets, m_range, decision.above)


def _site_plan(site, stats, choice: FormatSpec, reason, candidates, buckets, m_range=None, above=None) -> SitePlan:
    element = site.weight.element_size()
    after = next((c.nbytes for c in candidates if c.format == str(choice)), stats.numel * element)
    return SitePlan(
        name=site.name, module_path=site.module_path, shape=list(stats.shape), dtype=stats.dtype,
        m=site.m, epilogue=str(site.epilogue), density=round(stats.density, 6), fits=stats.fitting_patterns(),
        block_density={f"{h}x{w}": round(d, 6) for (h, w), d in stats.block_density.items()},
        candidates=candidates, choice=str(choice), reason=reason,
        bytes_before=stats.numel * element, bytes_after=after, buckets=buckets,
        m_range=list(m_range) if m_range else None, above=above)


def _replay(given: Plan, sites, stats, target, untraced, how: str = "replayed from a plan") -> Plan:
    by_name = {s.name: s for s in given.sites}
    missing = [s.name for s in sites if s.name not in by_name]
    extra = sorted(set(by_name) - {s.name for s in sites})
    if missing or extra:
        raise PlanError(f"the plan does not match this model: sites not in the plan {missing[:5]}, "
                        f"plan entries with no site {extra[:5]}")
    replayed = []
    for site in sites:
        entry = by_name[site.name]
        choice = FormatSpec.parse(entry.choice)
        if not stats[site.name].fits(choice):
            raise PlanError(f"the plan runs {site.name} as {choice}, but its weight does not fit {choice} "
                            "exactly (was it changed since the plan was made?)")
        if site.quantized and choice.kind not in QUANTIZED_KINDS:
            raise PlanError(f"the plan runs the FP8 site {site.name} as {choice}: an FP8 site runs as "
                            f"{' or '.join(QUANTIZED_KINDS)} only")
        replayed.append(_site_plan(site, stats[site.name], choice, f"{how}: {entry.reason}",
                                   entry.candidates, entry.buckets, entry.m_range, entry.above))
    return Plan(replayed, device=str(target), untraced=untraced)


def pack_sites(sites, stats, plan: Plan, cost_model: CostModel) -> dict[str, object]:
    """Pack each chosen weight once: for sparsecc's kernels where they run it (2:4, BSR and CSR on
    Hopper), else in the format's portable layout that the torch implementations read; the sites of
    a sibling group (:func:`sibling_groups`) once, stacked. The plan's ``bytes_after`` becomes the
    packed size (values plus indices; a group's shared by its members by rows). Returns the
    decisions splice takes (site name -> packed weight, its
    :class:`~sparsecc.ir.siblings.SiblingGroup`, or None for dense)."""
    decisions: dict[str, object] = {}
    for group in sibling_groups(sites, stats, plan, cost_model):
        if not _pack_group(group, plan, cost_model):
            for member in group.members:
                plan[member.name].group = None
            continue
        for member in group.members:
            decisions[member.name] = group
    packed_by_weight = {}
    for site in sites:
        if site.name in decisions:
            continue
        choice = FormatSpec.parse(plan[site.name].choice)
        if choice.kind == "dense":
            if site.quantized:          # its inputs' rounding: one kernel where it runs
                registry.prepare_quantized_dense(tuple(site.weight.shape), site.weight.device, site.input_dtype)
            decisions[site.name] = None
            continue
        key = (site.module_path, site.weight_name, site.weight_transposed, str(choice))
        if key not in packed_by_weight:
            packed_by_weight[key] = _pack_one(site, choice, cost_model.uses_kernel(stats[site.name], choice),
                                              plan[site.name])
        decisions[site.name] = packed_by_weight[key]
        plan[site.name].bytes_after = packed_by_weight[key].nbytes
    return decisions


def sibling_groups(sites, stats, plan: Plan, cost_model: CostModel) -> list[siblings.SiblingGroup]:
    """The sites that one call computes together (sparsecc.ir.siblings), as planned (the same
    format, batch range and tier above the small-batch kernels), but not a group whose stacked
    weight would leave the kernels its members run on. Members planned to run large batches on
    their dense weight share the small-batch call and keep their own weights above it, where the
    stacked weight has such a tier too."""
    choices = {s.name: (FormatSpec.parse(plan[s.name].choice), tuple(plan[s.name].m_range or ()),
                        plan[s.name].above) for s in sites}
    return [group for group in siblings.find(sites, choices, stats)
            if (cost_model.uses_kernel(group.stats, group.choice)
                or not any(cost_model.uses_kernel(stats[member.name], group.choice) for member in group.members))
            and (plan[group.members[0].name].above != ABOVE_DENSE or _has_small_tier(group, plan, cost_model))]


def _has_small_tier(group: siblings.SiblingGroup, plan: Plan, cost_model: CostModel) -> bool:
    """Whether a group's stacked weight packs, as its members do, for the small-batch kernels up to
    some rows of its range and not above (as the tuning tables stand: packing checks again)."""
    m_range = plan[group.members[0].name].m_range
    return bool(m_range) and cost_model.uses_kernel(group.stats, group.choice) and \
        registry.small_batch_tier(group.choice, getattr(torch, group.stats.dtype), group.stats.shape,
                                  *m_range) is not None


def mark_groups(sites, stats, plan: Plan, cost_model: CostModel) -> None:
    """Name each site's sibling group in its plan entry (``group``), as packing will form them."""
    for entry in plan:
        entry.group = None
    for group in sibling_groups(sites, stats, plan, cost_model):
        for member in group.members:
            plan[member.name].group = group.name


def _pack_group(group: siblings.SiblingGroup, plan: Plan, cost_model: CostModel) -> bool:
    """Pack a group's stacked weight; each member's plan entry takes what packing decided and its
    rows' share of the bytes. False (nothing recorded) where the members run their large batches
    on their dense weights but the stacked weight packs for one kernel family at every batch (its
    small-batch kernels would run the prefill, or its GEMMs the decode): each then runs alone."""
    scratch = replace(plan[group.members[0].name], reason="")
    packed = _pack_one(group.site(), group.choice, cost_model.uses_kernel(group.stats, group.choice), scratch)
    if plan[group.members[0].name].above == ABOVE_DENSE:
        packed = registry.members_dense_above(packed, [member.weight.detach() for member in group.members])
        if packed is None:
            return False
    group.packed = packed
    for member in group.members:
        entry = plan[member.name]
        entry.reason += scratch.reason
        entry.bytes_after = group.packed.nbytes * member.out_features // group.stats.shape[0]
    return True


def _pack_one(site: LinearSite, choice: FormatSpec, on_kernel: bool, entry: SitePlan):
    """``site``'s weight packed as ``choice``; what packing decided is added to ``entry``'s reason."""
    if on_kernel and site.quantized:
        refused = registry.refusal(choice, tuple(site.weight.shape), site.weight.dtype, input_dtype=site.input_dtype)
        if refused:
            entry.reason += f"; its inputs run on the reference op instead: {refused}"
            on_kernel = False
    if on_kernel:
        lo, hi = entry.m_range or (site.m or DEFAULT_M,) * 2
        try:
            packed = registry.pack(site.weight, choice, hi, tune_range=(lo, hi), progress=True, above=entry.above,
                                   input_dtype=site.input_dtype)
        except KernelBuildError as error:
            if settings().on_build_error != "fallback":
                raise
            log.warning("%s runs on torch: its kernel did not build (SPARSECC_ON_BUILD_ERROR=fallback): %s",
                        site.name, str(error).splitlines()[0])
            entry.reason += f"; its kernel failed to build, so it runs on torch: {str(error).splitlines()[0]}"
            return pack(site.weight, choice)
        if choice == NM_2_4 and not site.quantized:
            family = registry.candidates(choice, site.weight.dtype, tuple(site.weight.shape), hi)[0]
            if family.max_m is not None:
                entry.reason += (f"; batch {hi} <= {family.max_m}: the memory-bound {family.unit} (larger "
                                 "batches run on it too, slower than on the GEMMs)")
        if getattr(packed, "selection", ""):
            entry.reason += f"; packed for {packed.selection}"
        return packed
    return pack(site.weight, choice)


class PackedSources:
    """A compiled module's check, before each call, that the weights it packed are still the
    model's: a weight changed in place (an optimizer step, ``mul_``) or replaced after compile
    would leave the packed copy stale, so the call is refused with the fix instead (sites that
    stayed dense read the model's weight and follow it). Weak references: the compiled module
    keeps no weight alive. Skipped while torch.compile traces the module; a module saved and
    loaded again has no model to compare with. With nothing packed there is nothing to check, and
    compile registers none (a hook costs each call, e.g. each generated token).

    A weight made under ``torch.inference_mode()`` keeps no version counter: of such a weight only
    its replacement is caught, not a change in place.

    Each watched weight costs two attribute reads per call (its version, its owner's parameter),
    about 0.2 us on a CPU core: 22 us for the 112 linear layers of a Llama-1B. A weight several
    sites share (a layer called twice) is watched once."""

    def __init__(self, model: nn.Module, sites: list[LinearSite], decisions: dict):
        self.watched = []
        seen = set()
        for site in sites:
            if decisions.get(site.name) is None:
                continue
            path = ".".join(p for p in (site.module_path, site.weight_name) if p)
            if path in seen:
                continue
            seen.add(path)
            owner_path, _, attribute = path.rpartition(".")
            try:
                owner = model.get_submodule(owner_path)
            except AttributeError:
                continue
            if isinstance(owner, sharded.LocalShard):     # watch the user's layer, whose parameter it is
                owner = owner.original or owner
            tensor = getattr(owner, attribute, None)
            if isinstance(tensor, torch.Tensor):
                version = None if tensor.is_inference() else tensor._version
                self.watched.append((path, weakref.ref(owner), attribute, weakref.ref(tensor), version))

    def __call__(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return
        if module.training and torch.is_grad_enabled() and self.watched:
            raise SparseccError("a module from sparsecc.compile runs inference: its packed weights get no "
                                "gradients. Call .eval() on it (and run it under torch.no_grad()), or fine-tune "
                                "the model itself (sparsecc.pruning.attach_to_optimizer keeps its masks) and "
                                "compile it afterwards")
        # once per call (per generated token in generate): a parameter is looked up in its
        # owner's _parameters first, 5x faster than nn.Module.__getattr__
        for path, owner, attribute, tensor, version in self.watched:
            live_owner, live = owner(), tensor()
            if live_owner is None or live is None:
                continue
            replaced = (live_owner._parameters.get(attribute, live_owner) is not live
                        and getattr(live_owner, attribute, None) is not live)
            if replaced or (version is not None and live._version != version):
                raise SparseccError(f"the weight {path} changed after sparsecc.compile packed it (in place, or "
                                    "replaced): the compiled module would use the old values. Compile the model "
                                    "again after changing its weights")

    def __getstate__(self):
        return {"watched": []}


def _verify(compiled: nn.Module, prepared: _Prepared) -> None:
    """Check the compiled model against the eager output on the example inputs."""
    if prepared.model.training:
        log.info("model is in training mode (dropout is random): the compiled output is not verified")
        return
    with torch.no_grad():
        got = compiled(*prepared.args, **prepared.kwargs)
    expected_leaves, expected_spec = pytree.tree_flatten(prepared.traced.output)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if len(expected_leaves) != len(got_leaves):
        raise SparseccError(f"compiled model returns {len(got_leaves)} values, the model {len(expected_leaves)}")
    for index, (want, have) in enumerate(zip(expected_leaves, got_leaves)):
        if not isinstance(want, torch.Tensor):
            continue
        if want.shape != have.shape or want.dtype != have.dtype:
            raise SparseccError(f"output {index}: compiled gives {tuple(have.shape)} {have.dtype}, "
                                f"the model {tuple(want.shape)} {want.dtype}")
        if not want.is_floating_point():
            if not torch.equal(want, have):
                raise SparseccError(f"output {index} differs from the eager model")
            continue
        error = relative_error(have, want)
        tolerance = VERIFY_TOLERANCE.get(want.dtype, 1e-2)
        if not error <= tolerance:
            raise SparseccError(f"compiled output {index} differs from the eager model: relative error "
                                f"{error:.3g} > {tolerance:g}. This is a sparsecc bug; compile with "
                                "formats=('dense',) to work around it, and please report it.")
