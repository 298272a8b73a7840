"""Which graph nodes write in place (sparsecc.ir.mutation), and how many such writes precede each node."""
import operator

import torch
import torch.fx as fx

from sparsecc.ir.mutation import writes_before, writes_in_place


def test_in_place_writes_are_told_from_operators_named_with_an_underscore():
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = {"and_": graph.call_function(operator.and_, (x, x)), "setitem": graph.call_function(operator.setitem, (x, 0, 1)),
             "iadd": graph.call_function(operator.iadd, (x, x)), "add_": graph.call_method("add_", (x, 1)),
             "torch.add out": graph.call_function(torch.add, (x, x), {"out": x}),
             "aten.add_": graph.call_function(torch.ops.aten.add_.Tensor, (x, x)),
             "aten.add": graph.call_function(torch.ops.aten.add.Tensor, (x, x)),
             "relu": graph.call_function(torch.relu, (x,)), "__getitem__": graph.call_method("__getitem__", (x, 0))}
    writes = {name for name, node in nodes.items() if writes_in_place(node)}
    assert writes == {"setitem", "iadd", "add_", "torch.add out", "aten.add_"}


def test_each_node_knows_how_many_writes_in_place_precede_it():
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(torch.relu, (x,))
    write = graph.call_method("mul_", (x, 2))
    second = graph.call_function(torch.relu, (x,))
    again = graph.call_function(operator.setitem, (x, 0, 1.0))
    last = graph.call_function(torch.relu, (x,))
    graph.output(last)
    counts = writes_before(graph)
    assert [counts[n] for n in (x, first, write, second, again, last)] == [0, 0, 0, 1, 1, 2]
