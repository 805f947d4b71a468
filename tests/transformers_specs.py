"""Capture SPECs of small ``transformers`` models with random weights (no download): GPT-2
(``Conv1D`` projections), Llama (``nn.Linear``, RMSNorm, rotary) and BERT (encoder, GELU)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

VOCAB = 128


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def gpt2() -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval(), {"input_ids": _ids()}


def llama() -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval(), {"input_ids": _ids()}


def bert() -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BertModel(cfg).eval(), {"input_ids": _ids()}


def gpt2_qat() -> tuple[Any, dict[str, torch.Tensor]]:
    """'Bring your own quantized model': GPT-2 with its Conv1D projections swapped for equivalent
    ``nn.Linear`` layers, prepared for quantization-aware training by torch.ao (fake-quant int8
    weights and activations) and calibrated on one batch. The same seed builds the same weights as
    :func:`gpt2`, so the fp32 capture of ``gpt2`` is its reference."""
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat
    from torch import nn

    model, inputs = gpt2()
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "Conv1D":
            lin = nn.Linear(m.weight.shape[0], m.nf)
            with torch.no_grad():
                lin.weight.copy_(m.weight.t())
                lin.bias.copy_(m.bias)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, lin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.qconfig = get_default_qat_qconfig("x86")
        model.train()
        prepare_qat(model, inplace=True)
        with torch.no_grad():
            model(**inputs)  # calibrate the observers
        model.apply(torch.ao.quantization.disable_observer)
    return model.eval(), inputs
