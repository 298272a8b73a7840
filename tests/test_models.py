"""sparsecc.models: the built-in causal LMs have their heads and generate, the base models do not;
a model is made on the device asked for (on ``meta``, a 1B model costs nothing)."""
import pytest
import torch

from sparsecc.compiler import generates
from sparsecc.models import BUILTIN, CAUSAL, load


@pytest.mark.parametrize("name,base", [("llama-1b-causal", "llama-1b"), ("gpt2-causal", "gpt2")])
def test_causal_lms_generate_and_their_base_models_do_not(name, base):
    model, ids = load(name, batch=2, seq=5, device="meta")
    plain, _ = load(base, batch=2, seq=5, device="meta")
    assert name in BUILTIN and name in CAUSAL and base not in CAUSAL
    assert generates(model) and not generates(plain)
    assert ids.shape == (2, 5) and ids.device.type == "meta"
    assert next(model.parameters()).device.type == "meta" and not model.training
    assert model.config.use_cache and not plain.config.use_cache
    hidden = {"llama-1b": 2048, "gpt2": 768}[base]
    assert model.get_input_embeddings().weight.shape[1] == hidden


def test_a_model_is_made_where_asked():
    model, x = load("mlp", batch=3)
    assert x.shape == (3, 784) and next(model.parameters()).device == torch.device("cpu")
    model, x = load("mlp", batch=3, device="meta")
    assert x.device.type == "meta" and next(model.parameters()).device.type == "meta"
