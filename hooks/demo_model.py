"""A small Llama-style decoder written with torch.nn: embedding, RMSNorm, RoPE attention, SwiGLU.

Fixed seed, no downloads. ``build()`` is a capture SPEC: ``opband capture hooks.demo_model:build``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 512
    dim: int = 128
    layers: int = 4
    heads: int = 4
    hidden: int = 344
    seq: int = 32
    batch: int = 2
    eps: float = 1e-6
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: DecoderConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.dim // cfg.heads // 2
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32, device=device), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.use_sdpa = False  # the explicit softmax path names every op; SDPA is one fused op

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.heads
        q = self.q_proj(x).view(b, s, self.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / hd**0.5
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_tables(self.cfg, input_ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class TinyLlama(nn.Module):
    """``model.layers.N.mlp.down_proj`` … paths, as in Hugging Face's LlamaForCausalLM."""

    def __init__(self, cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or DecoderConfig()
        self.model = Decoder(self.cfg)
        self.lm_head = nn.Linear(self.cfg.dim, self.cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def build(cfg: DecoderConfig | None = None, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The demo model and its example input, identical on every machine for a given seed."""
    cfg = cfg or DecoderConfig()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    return model, (ids,)


def build_large() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A wider variant whose plain CPU forward takes >= 0.1 s on 2 cores (for the capture benchmark).

    Width 1024 keeps the ratio of matmul work to activation bytes closer to real decoders (which
    are wider still) than a narrow model, where every op is memory bound.
    """
    return build(DecoderConfig(dim=1024, hidden=2752, layers=6, heads=8, seq=128, batch=2, vocab=2048))
