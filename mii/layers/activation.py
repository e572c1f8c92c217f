"""Activation functions by their Hugging Face names, and the gated form used by Llama-style MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mii.errors import UnsupportedModelError

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def gated(act, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a fused [..., 2 * d] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
