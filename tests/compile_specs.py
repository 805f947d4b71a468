"""Capture SPECs for the compiled-target tests: a 2-layer Llama-style decoder, and the same with a
fault inside layer 1 (its down_proj weight 0.5% too large: a wrong kernel inside a compiled block)."""

from __future__ import annotations

import torch

from hooks import demo_model
from hooks.demo_model import DecoderConfig

TINY = DecoderConfig(vocab=128, dim=64, layers=2, heads=4, hidden=128, seq=8, batch=2)


def tiny_decoder() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    return demo_model.build(TINY)


def tiny_decoder_fault() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    model, inputs = demo_model.build(TINY)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.005)
    return model, inputs
