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


def t5() -> tuple[torch.nn.Module, dict[str, Any]]:
    """An encoder-decoder: the encoder runs once, in the prefill step."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg).eval(), {"input_ids": prompt()}


def llama_padded() -> tuple[torch.nn.Module, dict[str, Any]]:
    """Two prompts in one batch, the shorter left-padded."""
    model, _ = llama()
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return model, {"input_ids": ids, "attention_mask": mask}


def llama_static() -> tuple[torch.nn.Module, dict[str, Any]]:
    """``generate()`` over a static (preallocated) KV cache."""
    model, inputs = llama()
    model.generation_config.cache_implementation = "static"
    return model, inputs


class PositionsRestart(torch.nn.Module):
    """From decode step ``bad_step`` on, position ids restart at 0: a port that forgets the cache length."""

    def __init__(self, inner: torch.nn.Module, bad_step: int, attr: str) -> None:
        super().__init__()
        self.inner, self.bad_step, self.attr = inner, bad_step, attr

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        name = "position_ids" if self.attr == "rotary" else "input"
        args, pos = (args[:-1], args[-1]) if len(args) > (self.attr == "rotary") else (args, kwargs.pop(name))
        if pos.shape[-1] == 1 and int(pos.flatten()[0]) >= PROMPT - 1 + self.bad_step:
            pos = torch.zeros_like(pos)
        return self.inner(*args, pos, **kwargs)


def break_positions(model: torch.nn.Module, name: str, bad_step: int) -> str:
    """Break the decode path's positions of ``model`` from ``bad_step``; the path of the module that breaks."""
    if name == "llama":
        path = "model.rotary_emb"
        model.model.rotary_emb = PositionsRestart(model.model.rotary_emb, bad_step, "rotary")
    else:
        path = "transformer.wpe"
        model.transformer.wpe = PositionsRestart(model.transformer.wpe, bad_step, "embedding")
    return path


def llama_positions_bug() -> tuple[torch.nn.Module, dict[str, Any]]:
    """:func:`llama` whose decode steps from the 4th on compute rotary positions from 0 (a forgotten cache length)."""
    model, inputs = llama()
    break_positions(model, "llama", 4)
    return model, inputs
