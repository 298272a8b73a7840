"""Models the command line, samples and benchmarks refer to by name, built from configs
(nothing is downloaded): ``mlp``, ``bert-base``, ``bert-large``, ``gpt2``, ``llama-1b``,
``vit-b16``, and the causal LMs ``gpt2-causal`` and ``llama-1b-causal`` (the same models with
their language-model heads, which generate); or ``path/to/file.py:function`` returning
``(model, example_inputs)``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

from .errors import InputError


def _hf(name: str, batch: int, seq: int):
    try:
        import transformers as hf       # optional: pip install sparsecc[models]
    except ImportError:
        raise InputError(f"the built-in model {name!r} is a Hugging Face architecture and needs transformers: "
                         "pip install 'sparsecc[models]'") from None
    if name.startswith("bert"):
        large = name == "bert-large"
        config = hf.BertConfig(hidden_size=1024 if large else 768, num_hidden_layers=24 if large else 12,
                               num_attention_heads=16 if large else 12, intermediate_size=4096 if large else 3072)
        return hf.BertModel(config, add_pooling_layer=False), torch.randint(0, config.vocab_size, (batch, seq))
    causal = name.endswith("-causal")     # with the LM head, and a KV cache to generate with
    if name.startswith("gpt2"):
        config = hf.GPT2Config(use_cache=causal)
        model = hf.GPT2LMHeadModel(config) if causal else hf.GPT2Model(config)
        return model, torch.randint(0, config.vocab_size, (batch, seq))
    if name.startswith("llama-1b"):       # Llama-3.2-1B's shapes, with a 32k vocabulary
        config = hf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, use_cache=causal)
        model = hf.LlamaForCausalLM(config) if causal else hf.LlamaModel(config)
        return model, torch.randint(0, config.vocab_size, (batch, seq))
    if name == "vit-b16":
        config = hf.ViTConfig()
        return hf.ViTModel(config, add_pooling_layer=False), torch.randn(batch, 3, 224, 224)
    raise KeyError(name)


BUILTIN = ("mlp", "bert-base", "bert-large", "gpt2", "llama-1b", "vit-b16", "gpt2-causal", "llama-1b-causal")
#: the built-in models that generate text
CAUSAL = ("gpt2-causal", "llama-1b-causal")


def load(spec: str, *, batch: int = 8, seq: int = 128, device=None) -> tuple[nn.Module, object]:
    """The model and example inputs named by ``spec``; a built-in one is made on ``device`` (default:
    torch's default device), which for a large model is much faster on the GPU than made and moved."""
    if spec == "mlp":
        with torch.device(device or torch.get_default_device()):
            model = nn.Sequential(nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(), nn.Linear(100, 10))
            return model, torch.randn(batch, 784)
    if spec in BUILTIN:
        with torch.device(device or torch.get_default_device()):
            model, inputs = _hf(spec, batch, seq)
        return model.eval(), inputs
    path, _, function = spec.partition(":")
    if not function or not Path(path).is_file():
        raise InputError(f"model {spec!r}: use one of {BUILTIN} or path/to/file.py:function")
    module_spec = importlib.util.spec_from_file_location("sparsecc_user_model", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, function, None)):
        raise InputError(f"{path} defines no function {function!r} (MODEL is file.py:function returning "
                         "(model, example_inputs))")
    built = getattr(module, function)()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise InputError(f"{spec} must return (model, example_inputs)")
    return built
