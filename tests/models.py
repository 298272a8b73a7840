"""Small models the tests compile: Hugging Face architectures built from configs (no
downloads), and a seed-style MLP."""
from __future__ import annotations

import torch
import torch.nn as nn


def mlp(sizes=(784, 300, 100, 10)) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def bert(hidden=64, layers=2, intermediate=128):
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                intermediate_size=intermediate, vocab_size=100, max_position_embeddings=64)).eval()


def gpt2(hidden=64, layers=2):
    from transformers import GPT2Config, GPT2Model
    return GPT2Model(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=100, n_positions=64,
                                bos_token_id=0, eos_token_id=0)).eval()


def llama(hidden=64, layers=2, intermediate=128):
    from transformers import LlamaConfig, LlamaModel
    return LlamaModel(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=intermediate, vocab_size=100,
                                  max_position_embeddings=64)).eval()


def sparsify_24(model: nn.Module) -> None:
    """Make every linear weight 2:4 (largest two magnitudes of each 4 along K) in place."""
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or isinstance(module, nn.Embedding):
                continue
            # GPT-2's Conv1D stores [K, N]: its groups run along dim 0
            w = weight.t() if type(module).__name__ == "Conv1D" else weight
            if w.shape[1] % 4:
                continue
            groups = w.reshape(w.shape[0], -1, 4)
            keep = groups.abs().topk(2, dim=-1).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
            w.copy_((groups * mask).reshape_as(w))


def llama_lm(hidden=64, layers=2, intermediate=128, vocab=256):
    """A Llama causal LM (LlamaForCausalLM) that generates; token 0 pads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=intermediate, vocab_size=vocab,
                                        max_position_embeddings=128, pad_token_id=0)).eval()


def qwen2_lm(hidden=64, layers=2, intermediate=128, vocab=256):
    """A Qwen2 causal LM (Qwen2ForCausalLM: biases on q, k and v); token 0 pads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=intermediate, vocab_size=vocab,
                                        max_position_embeddings=128, pad_token_id=0)).eval()


def mistral_lm(hidden=64, layers=2, intermediate=128, vocab=256, window=8):
    """A Mistral causal LM (MistralForCausalLM) whose attention sees the last ``window`` tokens
    (a sliding window shorter than a prompt plus its new tokens); token 0 pads."""
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=intermediate, vocab_size=vocab,
                                            max_position_embeddings=128, pad_token_id=0,
                                            sliding_window=window)).eval()


def gpt2_lm(hidden=64, layers=2, vocab=256):
    """A GPT-2 causal LM (GPT2LMHeadModel, its head tied to the token embedding); token 0 pads."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=128,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
