"""The torch.compile backend on CPU: registered by name, lossless on Hugging Face models,
weight guards, dynamic batch, graph breaks."""
import pytest
import torch
import torch.nn as nn
import torch.fx as fx

import sparsecc
from sparsecc.backend import COMPILED, make_backend
from sparsecc.planner import check

from conftest import assert_rel_close
from models import bert, gpt2, llama, sparsify_24


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    COMPILED.clear()
    yield
    torch._dynamo.reset()


def test_backend_is_registered_by_name():
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import lookup_backend
    from sparsecc.backend import register, sparsecc_backend
    assert "sparsecc" in list_backends()
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    compiled = torch.compile(model, backend="sparsecc")
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    register()                  # by hand too, after Dynamo loaded it from the entry point
    assert lookup_backend("sparsecc") is sparsecc_backend


def test_register_by_hand_is_idempotent(monkeypatch):
    """``sparsecc.backend.register()`` registers the backend where no entry point did, and may be
    called again, also after Dynamo loaded the backend from the entry point."""
    from torch._dynamo.backends import registry
    from sparsecc.backend import register, sparsecc_backend
    monkeypatch.setattr(registry, "_BACKENDS", {})           # as if sparsecc were not installed
    monkeypatch.setattr(registry, "_COMPILER_FNS", {})
    monkeypatch.setattr(registry, "_lazy_import", lambda: None)
    register()
    register()
    assert registry.lookup_backend("sparsecc") is sparsecc_backend


def test_entry_point_is_declared():
    from importlib.metadata import entry_points
    names = {e.name: e.value for e in entry_points(group="torch_dynamo_backends")}
    assert names.get("sparsecc") == "sparsecc.backend:sparsecc_backend"


@pytest.mark.parametrize("build", [bert, gpt2, llama], ids=["bert", "gpt2", "llama"])
def test_hugging_face_models_through_the_backend(build):
    torch.manual_seed(0)
    model = build()
    sparsify_24(model)
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
    with torch.no_grad():
        for shape in [(2, 8), (3, 5)]:
            ids = torch.randint(0, 100, shape)
            assert_rel_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state, torch.float32, factor=10)
    choices = [c for graph in COMPILED for c in graph.plan.choices().values()]
    assert choices and choices.count("2:4") >= 6


def test_sites_reading_one_input_share_one_call_in_dynamos_graph():
    """In Dynamo's graph of a Llama the attention's q, k and v projections are siblings too (the
    MLP's gate and up as well): one call each group, and the result matches the model."""
    torch.manual_seed(0)
    model = llama()
    sparsify_24(model)
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        assert_rel_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state, torch.float32, factor=10)
    [graph] = COMPILED
    groups = {site.group for site in graph.plan if site.group}
    assert len(groups) == 4 and sum(site.group is not None for site in graph.plan) == 2 * (3 + 2)
    assert any(group.count("q_proj") == group.count("k_proj") == group.count("v_proj") == 1 for group in groups)
    calls = [n for n in graph._fn.__self__.graph.nodes if str(n.target) == "sparsecc.linear_nm.default"]
    assert len(calls) == 2 * 4                   # per layer: q+k+v, o, gate+up, down


def test_sites_on_either_side_of_a_write_in_place_to_their_input_do_not_share_a_call(gen):
    """In Dynamo's graph ``a(y); y.mul_(2); b(y)`` reads y before and after the write: a and b
    run alone (one call at a's place would give b the old values), while q, k and v share one."""
    from test_compiler import Untraceable
    model = Untraceable(gen).eval()
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
    x = torch.randn(4, 32, generator=gen)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32, factor=10)
    [graph] = COMPILED
    groups = {site.name.split("_modules_")[1].split("_")[0]: site.group for site in graph.plan}
    assert groups["a"] is None and groups["b"] is None
    assert groups["q"] is not None and groups["q"] == groups["k"] == groups["v"]


def test_inductor_takes_the_rest_of_the_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",)))
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    assert list(COMPILED[-1].plan.choices().values()) == ["2:4", "2:4"]


def test_inductor_can_write_its_wrapper_in_cpp():
    """cpp_wrapper=True: the generated code calls sparsecc's ops from C++ (through the
    dispatcher), with the same results."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16)).eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), options={"cpp_wrapper": True}))
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
        assert_rel_close(compiled(2 * x), model(2 * x), torch.float32)
    graph = COMPILED[-1]
    assert list(graph.plan.choices().values()) == ["2:4", "2:4"]
    assert 'findSchemaOrThrow("sparsecc::linear_nm"' in getattr(graph._fn, "source_code", "")


def test_changed_weights_are_never_used_stale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
    x = torch.randn(5, 32)
    with torch.no_grad():
        compiled(x)
        model[0].weight.mul_(-3.0)                       # in place: still 2:4
        assert_rel_close(compiled(x), model(x), torch.float32)
        model[2].weight.add_(1.0)                        # in place: now dense
        assert_rel_close(compiled(x), model(x), torch.float32)
        model[0].weight = nn.Parameter(torch.randn(32, 32))   # replaced
        assert_rel_close(compiled(x), model(x), torch.float32)
    graph = COMPILED[-1]
    assert graph.rebuilds >= 2 and graph.plan.choices() and "dense" in graph.plan.choices().values()


def test_dynamic_batch_does_not_recompile_per_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 8)).eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False), dynamic=True)
    with torch.no_grad():
        for rows in (2, 5, 17, 64):
            x = torch.randn(rows, 32)
            assert_rel_close(compiled(x), model(x), torch.float32)
    assert len(COMPILED) == 1


def test_graph_breaks_and_unknown_ops_run_as_usual():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if h.sum() > 0:                           # data-dependent: a graph break
                h = h * 2
            print_ok = torch.special.erfcx(h)          # an op sparsecc has no rule for
            return self.b(h + print_ok * 0)

    torch.manual_seed(0)
    model = Breaks().eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",), inductor=False))
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    assert len(COMPILED) >= 2


def test_backend_cost_model_charges_host_time_unless_under_cuda_graphs():
    """The backend plans op by op unless Inductor replays the graph from CUDA graphs."""
    from sparsecc.backend import SparseGraph, _inductor_options
    plain = SparseGraph(None, None, True, _inductor_options(None, None), None)
    graphed = SparseGraph(None, None, True, _inductor_options("reduce-overhead", None), None)
    eager = SparseGraph(None, None, False, _inductor_options("reduce-overhead", None), None)
    assert (plain.cuda_graphs, graphed.cuda_graphs, eager.cuda_graphs) == (False, True, False)
    with pytest.raises(sparsecc.SparseccError, match="torch.compile's modes"):
        _inductor_options("fastest", None)


def test_inductor_keeps_parameters_and_packed_weights_as_constant_inputs(monkeypatch):
    """The rewritten graph keeps what Dynamo recorded, so AOTAutograd marks every parameter and
    packed weight a static input (which CUDA graphs then keep in place instead of copying them
    in on every replay): only the activation is not static."""
    import torch._functorch.aot_autograd as aot_autograd
    found = []
    original = aot_autograd._try_get_metadata_from_dynamo

    def spy(module, param_keys, full_args_num, *rest):
        result = original(module, param_keys, full_args_num, *rest)
        found.append((full_args_num, result[1]))
        return result

    monkeypatch.setattr(aot_autograd, "_try_get_metadata_from_dynamo", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    sparsecc.prune(model, "2:4")
    compiled = torch.compile(model, backend=make_backend(formats=("2:4",)))
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    (inputs, static), = found
    assert len(static) == inputs - 1


def _checked(model):
    """``model`` under the backend with 2:4 forced and the whole-graph check on."""
    return torch.compile(model, backend=make_backend(formats=("2:4",), check_graph=True))


def _pruned_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    sparsecc.prune(model, "2:4")
    return model


def _patch_embedding():
    """A ViT-style patch embedding (a convolution sparsecc runs as a linear) and a linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 4, stride=4), nn.Flatten(2), nn.Linear(16, 32)).eval()


@pytest.mark.parametrize("build, formats, x_shape, rewritten",
                         [(_pruned_mlp, ("dense",), (4, 64), False),
                          (_pruned_mlp, ("2:4",), (4, 64), True),
                          (_patch_embedding, ("dense",), (2, 3, 16, 16), True)],
                         ids=["all-dense", "2:4", "patch-conv"])
def test_a_graph_with_no_sparse_site_goes_to_inductor_as_dynamo_captured_it(monkeypatch, build, formats,
                                                                            x_shape, rewritten):
    """Where every site stays dense and no convolution became a linear, Inductor compiles the graph
    Dynamo captured, unchanged (the epilogue fusion leaves a ReLU-ed linear's nodes otherwise): it
    runs as Inductor alone runs it. A sparse site or a patch convolution run as a linear (the faster
    form) keeps the rewrite."""
    import torch._inductor.compile_fx as compile_fx
    given = []
    original = compile_fx.compile_fx

    def spy(gm, inputs, *args, **kwargs):
        given.append([(n.op, str(n.target)) for n in gm.graph.nodes])
        return original(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", spy)
    model = build()
    compiled = torch.compile(model, backend=make_backend(formats=formats, check_graph=False))
    x = torch.randn(*x_shape)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    captured = [(n.op, str(n.target)) for n in COMPILED[-1].original.graph.nodes]
    assert (given[-1] != captured) == rewritten
    sparse = formats != ("dense",)
    assert set(COMPILED[-1].plan.choices().values()) == {"2:4" if sparse else "dense"}


@pytest.mark.parametrize("timed, sparse_faster", [(check.Raced(50.0, 100.0), True), (check.Raced(100.0, 101.0), False),
                                                   (check.Raced(97.0, 100.0), True),
                                                   (check.Raced(97.0, 100.0, second_host_bound=True), False)])
def test_the_rewritten_graph_runs_only_if_faster_than_the_dense_one(monkeypatch, timed, sparse_faster):
    """With check_graph, the rewritten graph is raced against Inductor's dense one on the example
    inputs; slower (or not by the larger margin where the host sets the dense graph's pace), the
    dense graph runs and every site's reason says why."""
    raced = []

    def race(first, second, *, cuda):
        raced.append((first, second))
        return timed

    monkeypatch.setattr(check, "race", race)
    model = _pruned_mlp()
    compiled = _checked(model)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    graph = COMPILED[-1]
    assert len(raced) == 1 and graph.plan.checked == [timed.first_us, timed.second_us] and graph.raced == timed
    if sparse_faster:
        assert set(graph.plan.choices().values()) == {"2:4"} and graph._watched
    else:
        assert set(graph.plan.choices().values()) == {"dense"} and not graph._watched
        assert all(f"ran {timed.first_us:.0f} us per call on the example inputs, the dense one {timed.second_us:.0f} us"
                   in s.reason for s in graph.plan)
        assert all(s.bytes_after == s.bytes_before for s in graph.plan)


def test_the_race_runs_on_the_graphs_first_call_not_while_dynamo_compiles(monkeypatch):
    """The rewritten graph and its dense rival are timed when the graph is first called (as the
    user's calls run), once: not inside the backend's compile."""
    raced, at_compile = [], []
    monkeypatch.setattr(check, "race", lambda first, second, *, cuda: raced.append(1) or check.Raced(50.0, 100.0))
    inner = make_backend(formats=("2:4",), check_graph=True)

    def backend(gm, inputs):
        compiled = inner(gm, inputs)
        at_compile.append(len(raced))
        return compiled

    model = _pruned_mlp()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 64)
    with torch.no_grad():
        for _ in range(2):
            assert_rel_close(compiled(x), model(x), torch.float32)
    assert at_compile == [0] and raced == [1]


def test_a_graph_that_writes_in_place_is_not_run_again(monkeypatch):
    """Extra calls of a graph that updates a buffer in place would change the model's state: such
    a graph is not raced, and the plan's choice stands."""
    monkeypatch.setattr(check, "race", lambda *a, **k: pytest.fail("raced a graph that writes in place"))

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _pruned_mlp()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.body(x)

    model = Counting()
    compiled = _checked(model)
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled(x)
    assert model.calls.item() == 1
    assert "2:4" in COMPILED[-1].plan.choices().values()


def test_a_graph_that_only_combines_masks_is_raced(monkeypatch):
    """``operator.and_`` (``a & b`` on masks, as causal LMs build attention masks) writes nothing:
    such a graph is raced like any other."""
    raced = []
    monkeypatch.setattr(check, "race", lambda first, second, **k: raced.append(1) or check.Raced(50.0, 100.0))

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _pruned_mlp()

        def forward(self, x):
            keep = (x > -10) & (x < 10)
            return self.body(torch.where(keep, x, 0.0))

    model = Masked()
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert_rel_close(_checked(model)(x), model(x), torch.float32)
    assert raced == [1]


def test_the_dense_graph_of_the_race_keeps_its_tensors_sources():
    """Both graphs of the race tell AOTAutograd where their tensors come from (else CUDA graphs
    copy the dense graph's weights in on every replay and the race is unfair to it)."""
    from sparsecc.backend import _dense_copy
    original = fx.symbolic_trace(nn.Linear(4, 4))
    original._param_name_to_source = {"weight": "the weight's source", "bias": "the bias's source"}
    copy = _dense_copy(original)
    assert copy is not original and copy._param_name_to_source == original._param_name_to_source
    assert str(copy.graph) == str(original.graph)


def test_a_check_that_fails_leaves_the_planned_graph(monkeypatch, caplog):

    def broken(*args, **kwargs):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(check, "race", broken)
    model = _pruned_mlp()
    compiled = _checked(model)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
    assert set(COMPILED[-1].plan.choices().values()) == {"2:4"}
    assert "was not timed against the dense one (no timer here)" in caplog.text


def test_the_race_runs_both_compiled_graphs():
    """Unpatched: both graphs Inductor compiled are run and timed, and whichever is kept computes
    the model's output (the plan says which: all 2:4, or all dense with the times)."""
    model = _pruned_mlp()
    compiled = _checked(model)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert_rel_close(compiled(x), model(x), torch.float32)
        assert_rel_close(compiled(2 * x), model(2 * x), torch.float32)
    choices = set(COMPILED[-1].plan.choices().values())
    assert choices in ({"2:4"}, {"dense"})
    if choices == {"dense"}:
        assert all("on the example inputs, the dense one" in s.reason for s in COMPILED[-1].plan)
