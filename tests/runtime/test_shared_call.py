"""SharedCall: sibling layers of different graphs take their outputs from one call, and only for
the tensor that call read (the same object, not written in place since), eagerly and under
torch.compile."""
import torch
import torch.nn as nn

from sparsecc.runtime.shared_call import SharedCall

SIZES = [8, 4, 4]


class Stacked(nn.Module):
    """x -> each member's part of x @ W^T for W stacked [16, 8]; counts its calls (eagerly: a
    counter would be a guard to Dynamo)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.calls = 0

    def forward(self, x):
        if not torch.compiler.is_compiling():
            self.calls += 1
        return tuple(torch.split(x @ self.weight.t(), SIZES, -1))


def expected(weight, x):
    return torch.split(x @ weight.t(), SIZES, -1)


def shared(gen):
    weight = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    return SharedCall(Stacked(weight), len(SIZES)), weight


def test_members_called_on_one_tensor_take_their_outputs_from_one_call(gen):
    call, weight = shared(gen)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    outputs = [call(x, index) for index in (1, 0, 2)]          # any order
    assert call.compute.calls == 1 and call.kept.value is None     # nothing kept once all took theirs
    for index, output in zip((1, 0, 2), outputs):
        torch.testing.assert_close(output, expected(weight, x)[index], rtol=0, atol=0)


def test_another_tensor_a_write_in_place_or_a_second_call_computes_again(gen):
    call, weight = shared(gen)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    y = x.clone()                                              # equal values, another tensor
    torch.testing.assert_close(call(x, 0), expected(weight, x)[0])
    torch.testing.assert_close(call(y, 1), expected(weight, y)[1])
    assert call.compute.calls == 2
    x.mul_(2)                                                  # written in place after member 0 read it
    call(x, 0)
    torch.testing.assert_close(call(x, 0), expected(weight, x)[0])   # member 0 again: not its kept output
    assert call.compute.calls == 4
    x.add_(1)
    torch.testing.assert_close(call(x, 1), expected(weight, x)[1])   # kept for the old values: computed
    assert call.compute.calls == 5


def test_under_torch_compile_the_members_share_one_call_in_one_graph(gen):
    """Dynamo traces the sharing into the graph: one product, no graph break, no recompile."""
    call, weight = shared(gen)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.call = call

        def forward(self, x):
            return self.call(x, 0).sum(-1) + self.call(x, 1).sum(-1) * self.call(x, 2).sum(-1)

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(Model(), backend=backend, fullgraph=True)
    for _ in range(2):
        x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
        want = [part.sum(-1) for part in expected(weight, x)]
        torch.testing.assert_close(compiled(x), want[0] + want[1] * want[2])
    [graph] = graphs
    products = [n for n in graph.graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
    assert len(products) == 1 and call.kept.value is None


def test_a_saved_module_keeps_no_activation(gen, tmp_path):
    call, weight = shared(gen)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    call(x, 0)
    assert call.kept.value is not None
    torch.save(call, tmp_path / "call.pt")
    loaded = torch.load(tmp_path / "call.pt", weights_only=False)
    assert loaded.kept.value is None
    torch.testing.assert_close(loaded(x, 2), expected(weight, x)[2])


def test_under_inference_mode_members_share_by_identity(gen):
    """A tensor made under torch.inference_mode() keeps no version: the members called on it share
    one call all the same, and another tensor still computes again."""
    call, weight = shared(gen)
    with torch.inference_mode():
        x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
        outputs = [call(x, index) for index in range(3)]
        y = x + 1
        torch.testing.assert_close(call(y, 0), expected(weight, y)[0])
    assert call.compute.calls == 2
    for index, output in enumerate(outputs):
        torch.testing.assert_close(output, expected(weight, x)[index])
