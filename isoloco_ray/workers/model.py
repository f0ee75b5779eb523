"""The Llama model of a run, built locally from its config (never downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from isoloco_ray.config import ModelConfig


def llama_config(model: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The Hugging Face config of `model` with the data's vocabulary size."""
    return LlamaConfig(
        vocab_size=model.vocab_size or vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=model.max_seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )


def build_model(model: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama; the same seed gives the same weights on every worker."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = LlamaForCausalLM(llama_config(model, vocab_size))
    return net.float()


def count_parameters(net: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)
