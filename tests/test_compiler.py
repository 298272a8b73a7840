"""sparsecc.compile / sparsecc.plan end to end on CPU: lossless on random models, exact
choices only, the formats restriction, plan replay, Hugging Face models, bad input."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sparsecc
from sparsecc import CostModel
from sparsecc.ir.analysis import analyze
from sparsecc.errors import InputError, PlanError, SparseccError
from sparsecc.ir.formats import FormatSpec, pack

from conftest import TOLERANCE, assert_rel_close, block_sparse, n_m, rel_error, unstructured
from models import bert, gpt2, llama, mlp, sparsify_24

ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "none": lambda t: t}


class RandomNet(nn.Module):
    """Linear layers of given sizes and epilogues; the last one is applied as W @ x^T."""

    def __init__(self, weights, biases, acts):
        super().__init__()
        self.weights = nn.ParameterList(weights)
        self.biases = nn.ParameterList(biases)
        self.acts = acts

    def forward(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if i == len(self.weights) - 1:
                x = (w @ x.transpose(-1, -2)).transpose(-1, -2) + b
            else:
                x = ACTS[self.acts[i]](F.linear(x, w, b))
        return x


@st.composite
def random_nets(draw):
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    depth = draw(st.integers(1, 3))
    sizes = [draw(st.sampled_from([8, 13, 32, 48, 64]))]
    weights, biases, acts = [], [], []
    for _ in range(depth):
        pattern = draw(st.sampled_from(["unstructured", "2:4", "1:4", "4:8", "block16", "dense"]))
        out = draw(st.sampled_from([16, 32, 48, 19]))
        k = sizes[-1]
        if pattern == "unstructured":
            w = unstructured(out, k, draw(st.floats(0.0, 0.6)), gen)
        elif pattern == "block16" and out % 16 == 0 and k % 16 == 0:
            w = block_sparse(out, k, (16, 16), draw(st.floats(0.1, 0.6)), gen)
        elif ":" in pattern:
            n, m = map(int, pattern.split(":"))
            w = n_m(out, k, n, m, gen)
        else:
            w = unstructured(out, k, 1.0, gen)
        weights.append(nn.Parameter(w.to(dtype)))
        biases.append(nn.Parameter(torch.randn(out, generator=gen).to(dtype)))
        acts.append(draw(st.sampled_from(list(ACTS))))
        sizes.append(out)
    batch = draw(st.integers(1, 64))
    lead = draw(st.sampled_from([(), (2,)]))
    x = torch.randn(*lead, batch, sizes[0], generator=gen).to(dtype)
    formats = draw(st.sampled_from([None, ("2:4",), ("csr",), ("bsr",), ("4:8", "1:4"), ("csr", "2:4", "bsr16")]))
    return RandomNet(weights, biases, acts).eval(), x, formats, dtype


@settings(max_examples=40, deadline=None)
@given(case=random_nets())
def test_compile_is_lossless_and_chooses_only_exact_formats(case):
    model, x, formats, dtype = case
    compiled = sparsecc.compile(model, (x,), formats=formats, cost_model=CostModel("cpu", measure=False))
    plan = compiled.sparsecc_plan
    assert len(plan) == len(model.weights)
    for site, weight in zip(plan, model.weights):
        assert analyze(weight.detach()).fits(FormatSpec.parse(site.choice)), (site.choice, site.reason)
        if formats is not None and site.choice == "dense":
            assert "fits none" in site.reason
    # fresh inputs, another batch size: the compiled module is shape-generic
    for rows in (x.shape[-2], 3):
        fresh = torch.randn(*x.shape[:-2], rows, x.shape[-1]).to(dtype)
        with torch.no_grad():
            assert_rel_close(compiled(fresh), _fp64(model, fresh), dtype, factor=3)


def _fp64(model, x):
    """The model's function in fp64 (the reference the dtype tolerances are stated against)."""
    h = x.double()
    for i, (w, b) in enumerate(zip(model.weights, model.biases)):
        w, b = w.double(), b.double()
        h = (w @ h.transpose(-1, -2)).transpose(-1, -2) + b if i == len(model.weights) - 1 else ACTS[model.acts[i]](F.linear(h, w, b))
    return h


def test_formats_24_uses_24_wherever_it_fits(gen):
    model = mlp((64, 48, 32, 10)).eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(48, 64, 2, 4, gen))
        model[2].weight.copy_(n_m(32, 48, 1, 4, gen))      # 1:4 also fits 2:4
    compiled = sparsecc.compile(model, torch.randn(5, 64), formats=("2:4",))
    assert list(compiled.sparsecc_plan.choices().values()) == ["2:4", "2:4", "dense"]
    assert compiled.sparsecc_plan["4"].reason.startswith("formats=(2:4)")
    x = torch.randn(7, 64)
    assert_rel_close(compiled(x), model(x), torch.float32)


def test_plan_json_replay(gen, tmp_path):
    model = mlp((32, 32, 8)).eval()
    with torch.no_grad():
        model[0].weight.copy_(unstructured(32, 32, 0.1, gen))
        model[0].weight[0, :4] = 1.0          # one full group of 4: the weight does not fit 2:4
    x = torch.randn(4, 32)
    plan = sparsecc.plan(model, x, formats=("csr",))
    path = tmp_path / "plan.json"
    plan.to_json(path)
    loaded = sparsecc.Plan.from_json(path)
    assert loaded.choices() == plan.choices() == {"0.weight": "csr", "2.weight": "csr"}
    assert sparsecc.Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    compiled = sparsecc.compile(model, x, plan=loaded)
    assert compiled.sparsecc_plan.choices() == plan.choices()
    assert "replayed" in compiled.sparsecc_plan["0"].reason
    assert_rel_close(compiled(x), model(x), torch.float32)
    # a plan that asks for a format the weight does not fit is refused
    loaded.sites[0].choice = "2:4"
    with pytest.raises(PlanError, match="does not fit 2:4"):
        sparsecc.compile(model, x, plan=loaded)
    with pytest.raises(PlanError, match="does not match"):
        sparsecc.compile(mlp((32, 8)).eval(), x, plan=plan)
    with pytest.raises(PlanError, match="not a sparsecc plan"):
        sparsecc.Plan.from_json('{"sites": 3}')


def test_plan_table_says_what_and_why(gen):
    model = mlp((64, 32, 8)).eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(32, 64, 2, 4, gen))
    table = sparsecc.plan(model, torch.randn(16, 64), cost_model=CostModel("cpu", measure=False)).table()
    for text in ("layer", "N x K", "density", "fits", "candidates", "choice", "bytes before -> after",
                 "32x64", "2:4", "dense=", "bias+relu", "0.500"):
        assert text in table, text
    assert table.count("\n0:") == 1 and table.count("\n2:") == 1   # one reason line per site


def test_no_linear_layers_gives_an_equivalent_model_and_empty_plan():
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(2, 3, 10)
    compiled = sparsecc.compile(model, x)
    assert len(compiled.sparsecc_plan) == 0
    torch.testing.assert_close(compiled(x), model(x))


def test_unsupported_dtype_stays_dense_with_reason(gen):
    model = nn.Sequential(nn.Linear(16, 8)).double().eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(8, 16, 2, 4, gen).double())
    compiled = sparsecc.compile(model, torch.randn(3, 16, dtype=torch.float64), formats=("2:4",))
    site = compiled.sparsecc_plan["0"]
    assert site.choice == "dense" and "float64 is not supported" in site.reason
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), model(x))


def test_bad_inputs_raise_sparsecc_errors():
    model = mlp((16, 8)).eval()
    with pytest.raises(SparseccError, match="do not fit the model"):
        sparsecc.compile(model, torch.randn(2, 15))
    with pytest.raises(SparseccError, match="nn.Module"):
        sparsecc.compile(lambda x: x, torch.randn(2, 16))
    with pytest.raises(SparseccError, match="does not parse"):
        sparsecc.compile(model, torch.randn(2, 16), formats=("2:5:7",))
    with pytest.raises(InputError, match="allows nothing"):
        sparsecc.compile(model, torch.randn(2, 16), formats=())


def test_verification_catches_a_wrong_result(monkeypatch, gen):
    """If a packed weight computed something else, compile must refuse, not return it."""
    model = mlp((32, 16)).eval()
    with torch.no_grad():
        model[0].weight.copy_(unstructured(16, 32, 0.2, gen))
    real_pack = sparsecc.compiler.pack

    def corrupted_pack(weight, spec):
        return real_pack(weight * 1.01, spec)

    monkeypatch.setattr(sparsecc.compiler, "pack", corrupted_pack)
    with pytest.raises(SparseccError, match="differs from the eager model"):
        sparsecc.compile(model, torch.randn(4, 32), formats=("csr",))
    sparsecc.compile(model, torch.randn(4, 32), formats=("csr",), verify=False)   # the check is what caught it


def test_original_model_is_unchanged_and_still_runs(gen):
    model = bert()
    sparsify_24(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sparsecc.compile(model, torch.randint(0, 100, (2, 8)), formats=("2:4",))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("build", [bert, gpt2, llama], ids=["bert", "gpt2", "llama"])
def test_hugging_face_models_compile_and_match(build):
    torch.manual_seed(0)
    model = build()
    sparsify_24(model)
    ids = torch.randint(0, 100, (2, 8))
    compiled = sparsecc.compile(model, (ids,), formats=("2:4",))
    plan = compiled.sparsecc_plan
    assert len(plan) >= 7 and all(site.choice == "2:4" for site in plan), plan.table()
    assert plan.bytes_after < plan.bytes_before
    for shape in [(2, 8), (1, 5), (3, 11)]:      # other batch sizes and lengths: no re-tracing
        other = torch.randint(0, 100, shape)
        with torch.no_grad():
            assert_rel_close(compiled(other).last_hidden_state, model(other).last_hidden_state, torch.float32, factor=10)


def test_parts_whose_sites_all_stay_dense_keep_the_model_modules(gen):
    """A traced part whose sites all stay dense would compute what its module computes: compile
    keeps the model's module there (no graph in its place for Python to run and torch.compile to
    guard on), and with nothing packed it adds no check before each call. A part with a packed
    site is replaced, and so is a patch convolution rewritten as a linear, dense or not."""
    model = llama()
    with torch.no_grad():
        for layer in model.layers:
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.copy_(n_m(*linear.weight.shape, 2, 4, gen))
    ids = torch.randint(0, 100, (2, 8))
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    assert {c for n, c in compiled.sparsecc_plan.choices().items() if "mlp" in n} == {"2:4"}
    for layer, original in zip(compiled.layers, model.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert getattr(layer.self_attn, name) is getattr(original.self_attn, name)
        assert isinstance(layer.mlp, torch.fx.GraphModule)
    assert compiled._forward_pre_hooks
    dense = sparsecc.compile(model, ids, formats=("dense",))
    assert type(dense) is type(model) and dense is not model
    assert all(a is b for a, b in zip(dense.children(), model.children()))
    assert not dense._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(dense(ids).last_hidden_state, model(ids).last_hidden_state)
    patches = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.Flatten()).eval()
    compiled = sparsecc.compile(patches, torch.randn(2, 3, 8, 8), formats=("dense",))
    assert list(compiled.sparsecc_plan.choices().values()) == ["dense"]
    assert isinstance(compiled, torch.fx.GraphModule)
    assert not any(isinstance(module, nn.Conv2d) for module in compiled.modules())


def test_an_mlps_gate_and_up_share_one_call(gen):
    """Llama's gate and up projections read the same input: planned 2:4 both, they run as one call
    on their stacked weight (gate's SiLU after the split), and the plan says so; the compiled model
    matches the model at other shapes. Planned for a batch range whose large batches run on the
    dense weights (a causal LM's prefill), each keeps its own call on the CPU, where no small-batch
    kernel could serve their stacked weight."""
    torch.manual_seed(0)
    model = llama()
    sparsify_24(model)
    ids = torch.randint(0, 100, (2, 8))
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    plan = compiled.sparsecc_plan
    pair = "layers.0.mlp.gate_proj.weight+layers.0.mlp.up_proj.weight"
    assert plan["layers.0.mlp.gate_proj"].group == plan["layers.0.mlp.up_proj"].group == pair
    assert plan["layers.0.mlp.down_proj"].group is None and plan["layers.0.self_attn.o_proj"].group is None
    assert "gate_proj: 2:4 -- " in plan.table() and "computed in one call with layers.0.mlp.up_proj.weight" in plan.table()
    assert sparsecc.plan(model, ids, formats=("2:4",))["layers.0.mlp.up_proj"].group == pair    # planned so
    targets = [str(n.target) for n in compiled.layers[0].mlp.graph.nodes if n.op == "call_function"]
    assert targets.count("sparsecc.linear_nm.default") == 2            # gate and up, then down
    for shape in [(1, 5), (3, 11)]:
        other = torch.randint(0, 100, shape)
        with torch.no_grad():
            assert_rel_close(compiled(other).last_hidden_state, model(other).last_hidden_state, torch.float32,
                             factor=10)
    from sparsecc.compiler import _prepare, sibling_groups
    prepared = _prepare(model, ids, ("2:4",), None, None, given_plan=None)
    groups = sibling_groups(prepared.sites, prepared.stats, prepared.plan, prepared.cost_model)
    assert sorted(len(group.members) for group in groups) == [2, 2, 3, 3]    # each layer's MLP and attention
    for site in prepared.plan:
        site.above = "dense"
    assert sibling_groups(prepared.sites, prepared.stats, prepared.plan, prepared.cost_model) == []


class Untraceable(nn.Module):
    """An attention-like module sparsecc does not trace whole (its forward takes ``**kwargs``, as a
    Hugging Face attention's does), so each of its layers is a graph of its own: q, k and v read x; a and b read a copy of x that is written in
    place between their calls. 2:4 weights."""

    def __init__(self, gen):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16, bias=False), nn.Linear(32, 16)
        self.a, self.b = nn.Linear(32, 16), nn.Linear(32, 16)
        with torch.no_grad():
            for layer in (self.q, self.k, self.v, self.a, self.b):
                layer.weight.copy_(n_m(*layer.weight.shape, 2, 4, gen))

    def forward(self, x, **kwargs):
        y = x * 1.0
        a = self.a(y)
        y.mul_(2.0)
        attention = torch.relu(self.q(x))[..., :16] * self.k(x) + self.v(x)
        return torch.cat([attention, a * self.b(y)], -1)


@pytest.mark.parametrize("whole", [True, False])
def test_siblings_share_a_call_across_graphs_but_not_across_a_write_in_place(whole, gen):
    """q, k and v read one tensor and run as one call: in one graph where the module traces whole
    (inside a Sequential), else (one graph per layer) through one SharedCall their graphs hold, and
    so under torch.compile too. a and b, between whose calls their input is written in place, run
    alone either way. The compiled model matches the model at other shapes, eagerly and compiled."""
    from sparsecc.runtime.shared_call import SharedCall
    model = (nn.Sequential(Untraceable(gen)) if whole else Untraceable(gen)).eval()
    prefix = "0." if whole else ""
    x = torch.randn(4, 32, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    plan = compiled.sparsecc_plan
    qkv = "+".join(f"{prefix}{name}.weight" for name in "qkv")
    assert [plan[f"{prefix}{name}"].group for name in "qkvab"] == [qkv, qkv, qkv, None, None]
    assert len({id(m) for m in compiled.modules() if isinstance(m, SharedCall)}) == (0 if whole else 1)
    parts = [m for m in compiled.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(parts) == (1 if whole else 6)                 # q, k, v, a, b and the shared call
    assert len({id(type(m).forward.__globals__) for m in parts}) == 1      # one dict for Dynamo to guard
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    dynamo = torch.compile(compiled, backend=backend)
    with torch.no_grad():
        for shape in [(4, 32), (3, 5, 32), (4, 32)]:
            other = torch.randn(*shape, generator=gen)
            assert_rel_close(compiled(other), model(other), torch.float32, factor=10)
            assert_rel_close(dynamo(other), model(other), torch.float32, factor=10)
    products = [n for gm in graphs for n in gm.graph.nodes if "linear_nm" in str(n.target)]
    assert len(graphs) == 2 and len(products) == 2 * 3        # per shape: q+k+v, a, b


def test_siblings_run_dense_above_together_only_where_their_stacked_weight_keeps_that_tier(monkeypatch):
    """Siblings (gate and up; q, k and v) planned to run their large batches on their dense weights
    (on a GPU, as kernels would pack them) share a call only where the stacked weight has a small-batch tier too: then
    one small-batch call, and above it each member's own weight, the model's. Where the tables
    give the stacked weight none, or its packing turns out otherwise, each runs alone and the plan
    names no group."""
    import sparsecc.compiler as compiler
    from sparsecc.ir.siblings import SiblingGroup
    from sparsecc.kernels.by_rows import ByRowsWeight, GroupByRowsWeight
    from sparsecc.kernels.sparse24_small import MMA, Sparse24GemvWeight
    torch.manual_seed(0)
    model = llama()
    sparsify_24(model)
    ids = torch.randint(0, 100, (2, 8))

    def prepared(tier):
        monkeypatch.setattr(compiler.registry, "small_batch_tier", lambda spec, dtype, shape, lo, hi: tier)
        ready = compiler._prepare(model, ids, ("2:4",), None, None, given_plan=None)
        ready.cost_model.uses_kernel = lambda stats, spec: spec.kind == "nm"      # as on a GPU
        for site in ready.plan:
            site.above, site.m_range = "dense", [1, 16]
        compiler.mark_groups(ready.sites, ready.stats, ready.plan, ready.cost_model)
        return ready

    ready = prepared(None)
    assert all(site.group is None for site in ready.plan)
    ready = prepared((MMA.unit, 8))
    assert sum(site.group is not None for site in ready.plan) == 10   # gate and up; q, k and v; two layers
    monkeypatch.setattr(compiler, "_pack_one", lambda site, choice, on_kernel, entry: pack(site.weight, choice))
    decisions = compiler.pack_sites(ready.sites, ready.stats, ready.plan, ready.cost_model)
    assert not any(isinstance(d, SiblingGroup) for d in decisions.values())
    assert all(site.group is None for site in ready.plan)
    monkeypatch.setattr(compiler, "_pack_one", lambda site, choice, on_kernel, entry: ByRowsWeight(
        Sparse24GemvWeight.pack(site.weight.detach()).running([]), 8, None, site.weight.detach()))
    ready = prepared((MMA.unit, 8))
    decisions = compiler.pack_sites(ready.sites, ready.stats, ready.plan, ready.cost_model)
    groups = {id(d): d for d in decisions.values() if isinstance(d, SiblingGroup)}.values()
    assert len(groups) == 4 and sum(site.group is not None for site in ready.plan) == 10
    for group in groups:
        assert isinstance(group.packed, GroupByRowsWeight)
        assert [w.data_ptr() for w in group.packed.dense] == [m.weight.data_ptr() for m in group.members]


def test_fused_epilogues_in_hugging_face_blocks():
    plan = sparsecc.plan(llama(), torch.randint(0, 100, (1, 4)), cost_model=CostModel("cpu", measure=False))
    assert plan["layers.0.mlp.gate_proj"].epilogue == "silu"
    plan = sparsecc.plan(bert(), torch.randint(0, 100, (1, 4)), cost_model=CostModel("cpu", measure=False))
    assert plan["encoder.layer.0.intermediate.dense"].epilogue == "bias+gelu"


def test_kernel_build_failure_raises_or_falls_back(monkeypatch, gen):
    """A 2:4 site whose kernel does not build: KernelBuildError by default, torch (with the
    reason in the plan) when SPARSECC_ON_BUILD_ERROR=fallback."""
    from sparsecc.errors import KernelBuildError

    def broken(weight, spec, m, *, tune_range=None, progress=False, above=None, input_dtype=None):
        raise KernelBuildError("nvcc failed to compile sparsecc_x", command=["nvcc", "x.cu"], stderr="boom",
                               source_path="/tmp/x.cu")

    monkeypatch.setattr(sparsecc.kernels.registry, "pack", broken)
    monkeypatch.setattr(CostModel, "uses_kernel", lambda self, stats, spec: spec.kind == "nm")
    model = mlp((32, 16)).eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(16, 32, 2, 4, gen))
    x = torch.randn(3, 32)
    with pytest.raises(sparsecc.KernelBuildError, match="nvcc failed") as caught:
        sparsecc.compile(model, x, formats=("2:4",))
    assert caught.value.command == ["nvcc", "x.cu"] and caught.value.source_path == "/tmp/x.cu"
    monkeypatch.setenv("SPARSECC_ON_BUILD_ERROR", "fallback")
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    assert compiled.sparsecc_plan["0"].choice == "2:4" and "failed to build" in compiled.sparsecc_plan["0"].reason
    assert_rel_close(compiled(x), model(x), torch.float32)


def test_a_packed_weight_changed_after_compile_is_refused_not_used(gen):
    """The compiled module would use a stale packed copy: changing the weight in place, or
    replacing it, makes its next call raise; sites that stayed dense follow the model."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(64, 64, 2, 4, gen))
    x = torch.randn(8, 64, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    assert compiled.sparsecc_plan.choices() == {"0.weight": "2:4", "2.weight": "dense"}
    with torch.no_grad():
        model[2].weight.mul_(2.0)                       # a dense site: followed
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float32]
        model[0].weight.mul_(1.5)                       # the packed site: refused
        with pytest.raises(sparsecc.SparseccError, match="0.weight changed after sparsecc.compile"):
            compiled(x)
        again = sparsecc.compile(model, x, formats=("2:4",))
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        with pytest.raises(sparsecc.SparseccError, match="compile the model\\s+again|Compile the model again"):
            again(x)


def test_a_model_made_under_inference_mode_compiles_and_runs(gen):
    """Tensors made under torch.inference_mode() keep no version counter: a model made there
    compiles and runs (a packed weight replaced is still refused), and a model compiled outside
    runs inside it, its q, k and v still sharing a call."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=gen)
    with torch.inference_mode():
        model = llama()
        sparsify_24(model)
        compiled = sparsecc.compile(model, ids, formats=("2:4",))
        assert_rel_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state, torch.float32, factor=10)
        layer = model.layers[0].mlp.down_proj
        layer.weight = nn.Parameter(layer.weight.clone())
        with pytest.raises(sparsecc.SparseccError, match="down_proj.weight changed after sparsecc.compile"):
            compiled(ids)
    model = llama()
    sparsify_24(model)
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    assert compiled.sparsecc_plan["layers.0.self_attn.q_proj"].group is not None
    with torch.inference_mode():
        assert_rel_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state, torch.float32, factor=10)


def test_a_compiled_module_runs_inference_only(gen):
    """Gradients would not reach packed weights: calling the compiled module in training mode
    with gradients on is refused with the fix; in eval mode, or under no_grad, it runs."""
    model = nn.Sequential(nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(n_m(32, 64, 2, 4, gen))
    x = torch.randn(4, 64, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    assert compiled.training
    with pytest.raises(sparsecc.SparseccError, match="eval"):
        compiled(x)
    with torch.no_grad():
        assert rel_error(compiled(x), model(x)) <= TOLERANCE[torch.float32]
    compiled.eval()
    assert compiled(x).shape == (4, 32)


def test_a_compiled_module_saves_and_loads(gen, tmp_path):
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    with torch.no_grad():
        model[0].weight.copy_(n_m(32, 64, 2, 4, gen))
    x = torch.randn(4, 64, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",))
    torch.save(compiled, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), compiled(x))


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 32))
    with pytest.raises(sparsecc.InputError, match="meta device"):
        sparsecc.compile(model, torch.randn(4, 64))


def test_a_layer_used_twice_is_two_sites_but_its_bytes_count_once(gen):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    model = Twice().eval()
    with torch.no_grad():
        model.fc.weight.copy_(n_m(64, 64, 2, 4, gen))
    plan = sparsecc.plan(model, torch.randn(4, 64, generator=gen), formats=("2:4",))
    assert [site.name for site in plan.sites] == ["fc.weight", "fc.weight#2"]
    assert plan.bytes_before == 64 * 64 * 4


def _two_four_mlp(gen):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(n_m(*layer.weight.shape, 2, 4, gen))
    return model


@pytest.mark.parametrize("sparse_faster", [True, False])
def test_the_whole_model_check_keeps_the_compiled_model_only_if_faster(monkeypatch, gen, sparse_faster):
    """With check_graph, the compiled model is timed against the model on the example inputs;
    slower, the result runs the model's own dense layers and every site's reason says why."""
    from sparsecc.planner import check
    raced = []

    def race(first, second, *, cuda):
        raced.append((first(), second(), cuda))
        return check.Raced(50.0, 100.0) if sparse_faster else check.Raced(100.0, 101.0)

    monkeypatch.setattr(check, "race", race)
    model, x = _two_four_mlp(gen), torch.randn(4, 64, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",), check_graph=True)      # asked for: checked even so
    (sparse_out, dense_out, cuda), = raced
    assert not cuda
    assert_rel_close(sparse_out, model(x), torch.float32)
    assert torch.equal(dense_out, model(x))
    assert_rel_close(compiled(x), model(x), torch.float32)
    plan = compiled.sparsecc_plan
    assert plan.checked == ([50.0, 100.0] if sparse_faster else [100.0, 101.0])
    assert "timed as a whole on the example inputs: " in plan.table()
    assert sparsecc.Plan.from_json(plan.to_json()).checked == plan.checked
    if sparse_faster:
        assert "2:4" in plan.choices().values()
    else:
        assert set(plan.choices().values()) == {"dense"}
        assert all(isinstance(m, nn.Linear) for m in compiled.modules() if not isinstance(m, nn.Sequential)
                   and not isinstance(m, nn.ReLU))
        assert any("this model with its sparse layers ran 100 us per call on the example inputs, the dense one 101 us"
                   in s.reason for s in plan)


def test_the_whole_model_check_is_off_on_the_cpu_for_ranges_and_forced_formats(monkeypatch, gen):
    from sparsecc.planner import check
    monkeypatch.setattr(check, "race", lambda *a, **k: pytest.fail("raced where no check was asked for"))
    model, x = _two_four_mlp(gen), torch.randn(4, 64, generator=gen)
    sparsecc.compile(model, x, formats=("2:4",))                           # on the CPU: off by default
    sparsecc.compile(model, x, formats=("2:4",), check_graph=False)


def test_the_whole_model_check_races_for_real(gen):
    """Unpatched, on the CPU: both models run and are timed, and whichever is returned computes
    the model's output."""
    model, x = _two_four_mlp(gen), torch.randn(256, 64, generator=gen)
    compiled = sparsecc.compile(model, x, formats=("2:4",), check_graph=True)
    assert_rel_close(compiled(x), model(x), torch.float32)
    assert set(compiled.sparsecc_plan.choices().values()) in ({"2:4"}, {"dense"})


def test_when_the_whole_model_check_runs_by_default(gen):
    """On the GPU by default, for a plan made at one batch size with dense allowed; never when
    nothing is packed or the model trains; asked for, also for ranges, replays and forced formats."""
    import dataclasses

    from sparsecc.compiler import _checks_whole, _prepare
    model, x = _two_four_mlp(gen), torch.randn(4, 64, generator=gen)
    prepared = _prepare(model, x, ("2:4",), None, None, given_plan=None)
    prepared.plan.device = "cuda:0"                  # as planned on a GPU
    packed = {s.name: object() for s in prepared.sites}
    assert _checks_whole(None, prepared, packed, None, None)
    assert _checks_whole(None, prepared, packed, None, ("2:4", "dense"))
    assert not _checks_whole(None, prepared, packed, None, ("2:4",))             # sparse forced
    assert not _checks_whole(None, prepared, packed, prepared.plan, None)        # a replayed plan
    assert not _checks_whole(False, prepared, packed, None, None)
    assert not _checks_whole(True, prepared, {s.name: None for s in prepared.sites}, None, None)
    assert all(_checks_whole(True, prepared, packed, given, formats)
               for given, formats in ((prepared.plan, None), (None, ("2:4",))))
    ranged = dataclasses.replace(prepared, plan=dataclasses.replace(
        prepared.plan, sites=[dataclasses.replace(s, m_range=[1, 4]) for s in prepared.plan.sites]))
    assert not _checks_whole(None, ranged, packed, None, None) and _checks_whole(True, ranged, packed, None, None)
    prepared.plan.device = "cpu"
    assert not _checks_whole(None, prepared, packed, None, None)
    model.train()
    assert not _checks_whole(True, prepared, packed, None, None)


def test_a_model_cuda_graphs_cannot_capture_is_not_checked_on_the_gpu(monkeypatch, gen):
    """The sites were timed replayed from CUDA graphs: a model that cannot be captured is not
    timed as a whole some other way (op by op, the host's pace would decide), its plan stands."""
    from sparsecc.compiler import _dense_unless_faster, _prepare
    from sparsecc.planner import check
    monkeypatch.setattr(check, "captured", lambda *fns: None)
    monkeypatch.setattr(check, "race", lambda *a, **k: pytest.fail("raced without CUDA graphs"))
    model, x = _two_four_mlp(gen), torch.randn(4, 64, generator=gen)
    prepared = _prepare(model, x, ("2:4",), None, None, given_plan=None)
    prepared.plan.device = "cuda:0"
    compiled = object()
    assert _dense_unless_faster(compiled, prepared) is compiled
