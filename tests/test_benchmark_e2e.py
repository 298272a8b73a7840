"""benchmarks/e2e.py on the CPU: after the ViT attention change (``unmasked_attention``) the model
computes exactly what it did, eagerly and under torch.compile, and its SDPA calls carry no
mask (transformers builds none for an attention implementation it has no mask for); the timing
rounds rotate the implementations' order and keep each one's median."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import e2e  # noqa: E402


def small_vit():
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, image_size=32, patch_size=8)
    return transformers.ViTModel(config, add_pooling_layer=False).eval(), torch.randn(3, 3, 32, 32)


def test_unmasked_attention_keeps_the_output_and_passes_no_mask(monkeypatch):
    torch.manual_seed(0)
    model, x = small_vit()
    with torch.no_grad():
        reference = model(x)[0]
        masks = []
        sdpa = F.scaled_dot_product_attention

        def recording(*args, attn_mask=None, **kwargs):
            masks.append(attn_mask)
            return sdpa(*args, attn_mask=attn_mask, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        e2e.unmasked_attention(model)
        assert model.config._attn_implementation == e2e.UNMASKED_SDPA
        eager = model(x)[0]
        assert masks and all(mask is None for mask in masks)

        traced = []

        def inspect(gm, inputs):
            traced.extend(node.kwargs.get("attn_mask", "absent") for node in gm.graph.nodes
                          if "scaled_dot_product" in str(node.target))
            return gm

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=inspect)(x)[0]
    assert torch.equal(eager, reference)
    assert traced and all(mask is None for mask in traced)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-6)


def test_timing_rounds_rotate_the_order_and_keep_each_median():
    calls = []

    def timer(fn, inputs):
        calls.append(fn)
        return fn(len(calls))

    compiled = {"a": lambda turn: 10.0 + turn % 2, "b": lambda turn: 20.0, "c": lambda turn: 30.0 + turn}
    times = e2e.interleaved_us(compiled, None, rounds=6, timer=timer)
    rounds = [calls[i:i + 3] for i in range(0, 18, 3)]
    firsts = [r[0] for r in rounds]
    assert {firsts.count(fn) for fn in compiled.values()} == {2}       # each one opens two rounds
    assert all(sorted(map(id, r)) == sorted(map(id, compiled.values())) for r in rounds)
    assert times["b"] == 20.0 and 10.0 <= times["a"] <= 11.0
    turns = [i + 1 for i, fn in enumerate(calls) if fn is compiled["c"]]
    assert times["c"] == 30.0 + (turns[2] + turns[3]) / 2
