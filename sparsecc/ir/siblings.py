"""Sibling sites: linear sites that read the same input and run in the same sparse format, computed
by one kernel on their weights stacked along N.

Attention's query, key and value projections read the same activations, as do an MLP's gate and up
projections. Run one by one, each is a launch that reads x again (and, op by op, a call from the
host); at a few tokens a launch is mostly fixed cost. Stacked along N their weights are one weight
of the same format (an n:m pattern and CSR hold per row; BSR blocks stay aligned when each N is a
multiple of the block's height, checked on the stacked weight), so one launch computes every
site's output and a split gives each its own, a view of the shared output. Each output element is
the same sum as before, of the same products (only a tuning choice such as a split of K may differ
for the larger shape, as it may for any shape).

Sites of different graphs share a call too where they are known to read one tensor: the layers of a
module that does not trace whole (a Hugging Face attention) are traced one graph each, and the example
run tells which were called on the same tensor, unchanged in between (``LinearSite.reads``).

The shared kernel applies the members' activation where they all have the same one; otherwise none,
and each member's own activation follows its split (Inductor fuses it into the consumer; an MLP's
``silu(gate) * up`` is one such consumer). A member without a bias gets zeros in the stacked bias.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .analysis import WeightStats
from .epilogue import Activation
from .formats import FormatSpec
from .mutation import writes_before
from .site import LinearSite


@dataclass
class SiblingGroup:
    """Sites (in graph order) computed by one call: their weights stacked along N, packed once."""

    members: list[LinearSite]
    choice: FormatSpec
    stats: WeightStats                   # of the stacked weight
    packed: object = None                # the stacked weight packed (compiler.pack_sites)
    #: where the members sit in different graphs: the module their graphs share (passes.splice)
    shared: object = None

    @property
    def name(self) -> str:
        """The members' names joined by '+', e.g. ``layers.0.q_proj.weight+layers.0.k_proj.weight``."""
        return "+".join(member.name for member in self.members)

    @property
    def sizes(self) -> list[int]:
        return [member.out_features for member in self.members]

    @property
    def activation(self) -> Activation:
        """What the shared call applies: the members' activation where they all have the same one."""
        activations = {member.activation for member in self.members}
        return activations.pop() if len(activations) == 1 else Activation.NONE

    def weight(self) -> torch.Tensor:
        """The members' weights stacked: [sum of N, K] (a new tensor)."""
        return torch.cat([member.weight.detach() for member in self.members])

    def bias(self) -> torch.Tensor | None:
        """The members' biases stacked (zeros for a member without one); None where none has one."""
        if all(member.bias is None for member in self.members):
            return None
        first = self.members[0].weight
        return torch.cat([member.bias.detach().to(first.dtype) if member.bias is not None
                          else first.new_zeros(member.out_features) for member in self.members])

    def site(self) -> LinearSite:
        """A site standing for the whole group (the stacked weight, the shared epilogue), to pack."""
        first = self.members[0]
        return LinearSite(name=self.name, weight_name=self.name, weight=self.weight(), x=first.x, anchor=first.anchor,
                          bias=self.bias(), activation=self.activation, module_path=first.module_path,
                          input_shape=first.input_shape, input_dtype=first.input_dtype)


def find(sites: list[LinearSite], choices: dict[str, tuple], stats: dict[str, WeightStats]) -> list[SiblingGroup]:
    """The groups of two or more ``sites`` that can share a call: the same input (no write in
    place between them), the same sparse format and what else the packed weight is chosen for
    (``choices``: site name -> a tuple starting with its FormatSpec, e.g. with its batch range),
    the same weight dtype, device and K, neither transposed nor quantized, each weight a different
    tensor, and the stacked weight fitting the format (its statistics, from the members' ``stats``)."""
    groups = []
    for members in _sharing(sites, lambda site: None if choices[site.name][0].kind == "dense" else choices[site.name]):
        group = SiblingGroup(members, choices[members[0].name][0], stacked([stats[m.name] for m in members]))
        if group.stats.fits(group.choice):
            groups.append(group)
    return groups


def readers(sites: list[LinearSite]) -> list[list[LinearSite]]:
    """The sets of two or more ``sites`` that one call could compute if they were planned in the
    same sparse format: all but the format in common with :func:`find`'s groups."""
    return _sharing(sites, lambda site: ())


def _sharing(sites: list[LinearSite], choice_of) -> list[list[LinearSite]]:
    """``sites`` by their input (with no write in place between them), ``choice_of(site)`` (None:
    the site takes no part), weight dtype, device and K, leaving out transposed and quantized
    sites: the sets of two or more distinct weights."""
    by_key: dict[tuple, list[LinearSite]] = {}
    writes: dict[fx.Graph, dict[fx.Node, int]] = {}
    for site in sites:
        choice = choice_of(site)
        if choice is None or site.quantized or site.x_transposed or site.transpose_out:
            continue
        graph = site.anchor.graph
        if graph not in writes:
            writes[graph] = writes_before(graph)
        # sites on either side of a write in place do not read the same values
        key = (site.input_key, writes[graph][site.anchor], *choice, site.weight.dtype, site.weight.device,
               site.in_features, site.input_dtype)
        by_key.setdefault(key, []).append(site)
    return [members for members in map(_distinct_weights, by_key.values()) if len(members) >= 2]


def stacked(stats: list[WeightStats]) -> WeightStats:
    """The statistics of weights stacked along N, from theirs: a group of K's columns or a block
    never spans two of them (a block shape is measured only where it tiles a weight), so counts add
    up, the densest group bounds n:m, and block densities average over the rows."""
    rows = [s.shape[0] for s in stats]
    first = stats[0]
    return WeightStats(
        shape=(sum(rows), first.shape[1]), dtype=first.dtype, nnz=sum(s.nnz for s in stats),
        nm_min_n={m: max(s.nm_min_n[m] for s in stats) for m in first.nm_min_n if all(m in s.nm_min_n for s in stats)},
        beyond_24=sum(s.beyond_24 for s in stats),
        block_density={b: sum(s.block_density[b] * n for s, n in zip(stats, rows)) / sum(rows)
                       for b in first.block_density if all(b in s.block_density for s in stats)})


def _distinct_weights(members: list[LinearSite]) -> list[LinearSite]:
    """Each weight once (a layer called twice on the same input is one site's work twice)."""
    seen, distinct = set(), []
    for member in members:
        key = (member.weight.data_ptr(), member.weight.stride(), tuple(member.weight.shape))
        if key not in seen:
            seen.add(key)
            distinct.append(member)
    return distinct
