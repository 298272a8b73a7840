"""splice: a packed site becomes one custom-op call reading buffers; a dense site becomes
plain torch ops; the dense weight is no longer held; the original model is untouched."""
import torch
import torch.nn as nn

from sparsecc.ir.formats import pack
from sparsecc.passes import find_linear, fuse_epilogue, splice
from sparsecc.runtime.torch_ops import linear_torch

from conftest import assert_rel_close, n_m, unstructured

from .graphs import ops, traced


class TwoLayers(nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.a, self.b = nn.Linear(32, 16), nn.Linear(16, 8)
        with torch.no_grad():
            self.a.weight.copy_(n_m(16, 32, 2, 4, gen))
            self.b.weight.copy_(unstructured(8, 16, 0.3, gen))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def prepared(model, x):
    gm = traced(model, x)
    sites = find_linear.run(gm).sites
    fuse_epilogue.run(gm)
    return gm, sites


def test_packed_and_dense_sites(gen):
    model, x = TwoLayers(gen), torch.randn(3, 32, generator=gen)
    reference = model(x)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    gm, sites = prepared(model, x)
    packed = pack(sites[0].weight, "2:4")
    result = splice.run(gm, {"a.weight": packed, "b.weight": None})
    assert result.changed
    assert ops(gm) == [("get_attr", "a.bias"), ("get_attr", "sparsecc_packed_a_weight__values"),
                       ("get_attr", "sparsecc_packed_a_weight__indices"), ("call_function", "linear_nm.default"),
                       ("get_attr", "b.weight"), ("get_attr", "b.bias"), ("call_function", "linear_torch")]
    assert next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is linear_torch)
    assert torch.equal(gm.sparsecc_packed_a_weight__values, packed.values)
    assert_rel_close(gm(x), reference, torch.float32)
    # the graph module no longer reaches the dense weight of a; the model is unchanged
    assert not any(p is model.a.weight for p in gm.parameters())
    assert all(torch.equal(v, state_before[k]) for k, v in model.state_dict().items())
    assert set(model.state_dict()) == set(state_before)


def test_sites_not_in_decisions_are_left_as_fused(gen):
    model, x = TwoLayers(gen), torch.randn(3, 32, generator=gen)
    gm, _ = prepared(model, x)
    splice.run(gm, {"b.weight": pack(model.b.weight, "csr")})
    assert ("call_function", "linear_dense.default") in ops(gm)
    assert ("call_function", "linear_csr.default") in ops(gm)
    assert_rel_close(gm(x), model(x), torch.float32)


def test_shared_weight_packed_once_per_site_name(gen):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(unstructured(12, 12, 0.2, gen))

        def forward(self, x):
            return torch.nn.functional.linear(torch.nn.functional.linear(x, self.w), self.w)

    model, x = Tied(), torch.randn(2, 12, generator=gen)
    gm, sites = prepared(model, x)
    packed = pack(model.w, "csr")
    splice.run(gm, {"w": packed, "w#2": packed})
    assert not any(n.op == "get_attr" and n.target == "w" for n in gm.graph.nodes)
    assert_rel_close(gm(x), model(x), torch.float32)


def test_an_array_a_format_leaves_out_is_passed_as_none(gen):
    """A 2:4 site packed by rows with the dense weight above its small-batch limit has no
    metadata on its large tier: the op gets None, and no buffer stands for it."""
    from sparsecc.kernels.by_rows import ByRowsWeight
    from sparsecc.kernels.sparse24_small import Sparse24GemvWeight

    model, x = TwoLayers(gen), torch.randn(3, 32, generator=gen)
    gm, sites = prepared(model, x)
    weight = sites[0].weight.detach()
    packed = ByRowsWeight(Sparse24GemvWeight.pack(weight).running([]), 2, None, weight)
    splice.run(gm, {"a.weight": packed})
    reads = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "sparsecc_packed_a_weight__large_values" in reads
    assert not any(target.endswith("large_metadata") for target in reads)
    assert_rel_close(gm(x), model(x), torch.float32)      # 3 rows: above the limit, the dense tier


def test_siblings_share_one_call_split_into_their_outputs(gen):
    """A sibling group is one op call on the stacked weight where its first member was; a split
    gives each member its output, with its own activation where the call applies none; the members'
    dense weights are no longer held."""
    from sparsecc.ir import siblings
    from sparsecc.ir.analysis import analyze
    from sparsecc.ir.epilogue import apply_activation
    from sparsecc.ir.formats import FormatSpec
    from ir.test_siblings import Attention

    model, x = Attention(gen), torch.randn(2, 5, 32, generator=gen)
    gm, sites = prepared(model, x)
    [group] = siblings.find(sites, {s.name: (FormatSpec.parse("csr"), (), None) for s in sites},
                            {s.name: analyze(s.weight) for s in sites})
    group.packed = pack(group.weight(), "csr")
    decisions = {member.name: group for member in group.members}
    splice.run(gm, {**decisions, "out.weight": None})
    calls = [target for op, target in ops(gm) if op == "call_function"]
    assert calls[:3] == ["linear_csr.default", "split", "getitem"]
    assert calls.count("linear_csr.default") == 1 and calls.count("getitem") == 5 + 1     # and q's [..., :16]
    assert calls.count("apply_activation") == 2                                         # q's relu, gate's silu
    assert any(n.target is apply_activation and n.args[1] == "silu" for n in gm.graph.nodes)
    assert_rel_close(gm(x), model(x), torch.float32)
    held = [p for p in [*gm.parameters(), *gm.buffers()]]
    assert not any(p is getattr(model, name).weight for p in held for name in ("q", "k", "v", "gate", "up"))
    assert any(p is model.out.weight for p in held)


def test_siblings_planned_dense_above_the_small_batches_keep_their_own_weights_there(monkeypatch, gen):
    """A group whose members run their dense weights past the small-batch rows: one op call that
    gives each member its output (no split node), the group's small-batch arrays and the members'
    own weights as buffers (the model's tensors, not a stacked copy); above the limit the members'
    weights compute the model, at or below it one shared kernel call does."""
    import sparsecc.kernels.by_rows as by_rows
    from sparsecc.ir import siblings
    from sparsecc.ir.analysis import analyze
    from sparsecc.ir.formats import FormatSpec
    from sparsecc.kernels.sparse24_small import Sparse24GemvWeight
    from ir.test_siblings import Attention

    model, x = Attention(gen), torch.randn(2, 5, 32, generator=gen)
    gm, sites = prepared(model, x)
    choices = {s.name: (FormatSpec.parse("2:4"), (1, 10), "dense") for s in sites}
    [group] = siblings.find(sites, choices, {s.name: analyze(s.weight) for s in sites})
    stacked = group.weight()
    group.packed = by_rows.ByRowsWeight(Sparse24GemvWeight.pack(stacked).running([]), 4, None, stacked).for_members(
        [member.weight.detach() for member in group.members])
    splice.run(gm, {**{member.name: group for member in group.members}, "out.weight": None})
    calls = [target for op, target in ops(gm) if op == "call_function"]
    assert calls.count("linear_split_by_rows") == 1 and "split" not in calls
    held = {p.data_ptr() for p in gm.buffers()}
    assert all(getattr(model, name).weight.data_ptr() in held for name in ("q", "k", "v", "gate", "up"))
    assert_rel_close(gm(x), model(x), torch.float32)                    # 10 rows: the members' weights
    kernel_calls = []

    def kernel(x, values, metadata, n, k, bias, activation, x_transposed, transpose_out, kernels):
        kernel_calls.append(values)
        return torch.nn.functional.linear(x, stacked, bias)

    monkeypatch.setattr(by_rows, "linear_kernel", kernel)
    few = torch.randn(1, 3, 32, generator=gen)
    assert_rel_close(gm(few), model(few), torch.float32)
    assert len(kernel_calls) == 1 and kernel_calls[0] is group.packed.small.values


def test_a_view_of_a_siblings_output_still_works(gen):
    """A member's output is a strided view of the shared one: ``.view`` of it becomes ``.reshape``
    (``y.view(-1)`` of a split column block could not be a view)."""
    from sparsecc.ir import siblings
    from sparsecc.ir.analysis import analyze
    from sparsecc.ir.formats import FormatSpec

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 16), nn.Linear(32, 8)
            with torch.no_grad():
                self.a.weight.copy_(n_m(16, 32, 2, 4, gen))
                self.b.weight.copy_(n_m(8, 32, 2, 4, gen))

        def forward(self, x):
            return self.a(x).view(-1).sum() + self.b(x).view(x.shape[0], 2, 4)

    model, x = Flat(), torch.randn(3, 32, generator=gen)
    gm, sites = prepared(model, x)
    [group] = siblings.find(sites, {s.name: (FormatSpec.parse("2:4"), (), None) for s in sites},
                            {s.name: analyze(s.weight) for s in sites})
    group.packed = pack(group.weight(), "2:4")
    splice.run(gm, {member.name: group for member in group.members})
    assert ("call_method", "view") not in ops(gm) and ops(gm).count(("call_method", "reshape")) == 2
    assert_rel_close(gm(x), model(x), torch.float32)
