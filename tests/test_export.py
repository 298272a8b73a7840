"""``torch.export`` of a module compiled with ``sparsecc.compile``: the exported program keeps
sparsecc's ops (their fake implementations give the shapes) and computes what eager does."""
import pytest
import torch
import torch.nn as nn

import sparsecc

from conftest import assert_rel_close
from models import bert, llama, sparsify_24


@pytest.mark.parametrize("formats", [("2:4",), ("csr",)])
def test_exported_mlp_keeps_the_sparse_ops_and_a_dynamic_batch(formats):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()
    sparsecc.prune(model, "2:4")
    x = torch.randn(4, 64)
    compiled = sparsecc.compile(model, x, formats=formats)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(compiled, (x,), dynamic_shapes=({0: batch},))
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert sum("sparsecc." in op for op in ops) == 2, ops
    with torch.no_grad():
        for rows in (1, 9, 300):
            fresh = torch.randn(rows, 64)
            assert_rel_close(program.module()(fresh), model(fresh).double(), torch.float32)


def test_exported_bert_matches_eager():
    torch.manual_seed(0)
    model = bert()
    sparsify_24(model)
    ids = torch.randint(0, 100, (2, 16))
    compiled = sparsecc.compile(model, ids, formats=("2:4",))
    program = torch.export.export(compiled, (ids,))
    assert any("sparsecc.linear_nm" in str(n.target) for n in program.graph.nodes)
    fresh = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert_rel_close(program.module()(fresh)[0], model(fresh)[0].double(), torch.float32)


def test_exported_llama_keeps_one_call_per_group_of_siblings():
    """Llama's attention does not trace whole: its q, k and v share a call across their graphs
    (sparsecc.runtime.shared_call), and the exported program keeps that one call (with gate and
    up's, o's and down's: four per layer)."""
    torch.manual_seed(0)
    model = llama()
    sparsify_24(model)

    class Hidden(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids, use_cache=False).last_hidden_state

    ids = torch.randint(0, 100, (2, 8))
    program = torch.export.export(Hidden(sparsecc.compile(model, ids, formats=("2:4",))), (ids,))
    calls = [n for n in program.graph.nodes if "sparsecc.linear_nm" in str(n.target)]
    assert len(calls) == 4 * model.config.num_hidden_layers
    fresh = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        assert_rel_close(program.module()(fresh), model(fresh, use_cache=False).last_hidden_state.double(),
                         torch.float32)
