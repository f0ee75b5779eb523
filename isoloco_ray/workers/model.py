"""The Llama model of a run, built locally from its config (never downloaded)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from isoloco_ray.config import ModelConfig


def llama_config(model: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The Hugging Face config of `model` with the data's vocabulary size."""
    shape = model.shape
    return LlamaConfig(
        vocab_size=shape.vocab_size or vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_seq_len,
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,  # nothing random in training: checkpoints hold no RNG state
    )


def build_model(model: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama; the same seed gives the same weights on every worker."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = LlamaForCausalLM(llama_config(model, vocab_size))
    if model.activation_checkpointing:
        # Non-reentrant: recomputes under the same autocast and grad mode as the forward.
        # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
        kwargs = {"use_reentrant": False}
        if hasattr(net, "activation_checkpointing_enable"):
            net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return net.float()


def count_parameters(net: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def parameter_shapes(model: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The shape of every trainable parameter of the model `build_model` makes, without
    allocating it."""
    with torch.device("meta"):
        net = LlamaForCausalLM(llama_config(model, vocab_size))
    return {name: tuple(p.shape) for name, p in net.named_parameters() if p.requires_grad}


def parameters_of(model: ModelConfig, vocab_size: int) -> int:
    """count_parameters of the model `build_model` makes, without allocating it."""
    return sum(math.prod(shape) for shape in parameter_shapes(model, vocab_size).values())


@dataclass(frozen=True)
class Runtime:
    """How a worker runs its model: where, in which precision, through which forward."""

    device: torch.device
    bf16: bool  # bf16 autocast of forward passes (parameters and optimizer stay float32)
    forward: nn.Module  # the model, or its torch.compile'd wrapper (same parameters)

    @classmethod
    def create(cls, model: nn.Module, device: torch.device, autocast: str, compile: bool
               ) -> Runtime:
        """`autocast`: "auto" (bf16 on GPU, off on CPU, where it is no faster), "bf16", "off"."""
        bf16 = autocast == "bf16" or (autocast == "auto" and device.type == "cuda")
        # torch.compile of a Module is a Module (an OptimizedModule sharing its parameters).
        return cls(device, bf16, cast(nn.Module, torch.compile(model)) if compile else model)

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The precision context forward passes run in."""
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A host batch on the device; pinned and asynchronous on GPU."""
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)
