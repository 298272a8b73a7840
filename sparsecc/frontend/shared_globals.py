"""One globals dict for the code of the graph modules a compiled model is made of.

fx gives the generated ``forward`` of each graph module a globals dict of its own (``torch``, and
the functions its graph calls). When ``torch.compile`` traces a model made of many such modules
(``sparsecc.compile`` replaces each traceable part of a Hugging Face model by one), Dynamo guards,
on every call, that each of these dicts still holds the ``torch`` it saw in the others: one Python
guard per module (49 on a 16-layer Llama). With one dict for all of them it needs one.
"""
from __future__ import annotations

import types
from collections.abc import Iterable

import torch.fx as fx


def share_globals(modules: Iterable[fx.GraphModule]) -> None:
    """Rebind the generated ``forward`` of each of ``modules`` to one shared globals dict.

    Only the function's globals change (its code, defaults and closure stay), and only on the
    module's own class (fx makes one per graph module), so nothing else that uses fx is touched.
    A module with a name another one binds to a different object keeps its own dict, and a
    later ``recompile()`` gives a module its own dict back: both only cost the guard again.
    """
    scope: dict = {}
    for gm in modules:
        forward = type(gm).forward
        names = forward.__globals__
        if names is scope or any(scope.get(name, value) is not value for name, value in names.items()):
            continue
        scope.update(names)
        shared = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__,
                                    forward.__closure__)
        shared.__kwdefaults__ = forward.__kwdefaults__
        shared.__qualname__ = forward.__qualname__
        shared.__dict__.update(forward.__dict__)
        type(gm).forward = shared
