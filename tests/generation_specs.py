"""SPECs for ``opband capture --generate``: small random-weight ``transformers`` models and a prompt.

The weights are drawn wider than ``transformers``' default (std 0.02 makes a 2-layer model repeat one
token, whatever its inputs): with these a decode-step bug changes the generated tokens, and an honest
bf16 port of the same weights keeps them."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

PROMPT = 6


def prompt(batch: int = 1) -> torch.Tensor:
    """The prompt's token ids, the same at every call."""
    return torch.randint(0, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def llama() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    return transformers.LlamaForCausalLM(cfg).eval(), {"input_ids": prompt()}


def gpt2() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=1, initializer_range=0.4)
    return transformers.GPT2LMHeadModel(cfg).eval(), {"input_ids": prompt()}
