"""The first divergence blames the module whose own implementation differs, not a child that inherits.

A port that changes how an attention module computes (its own ops cannot be paired with the
reference's) and gets it wrong makes every op after it fail too; the earliest paired failing op is
then a child (``o_proj``, ``c_proj``) whose input came from the unpaired ops. The module itself is
the first divergence. Two architectures whose attention goes through ``transformers``' attention
interface; the reference runs the eager implementation, the target a registered one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

import accuracy  # noqa: E402
from accuracy.verdicts import Verdict  # noqa: E402
from hooks import capture  # noqa: E402


def _by_hand(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
             wrong: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a softmax written out (exp / sum, no max subtraction); ``wrong``: the sum is taken
    over one key too few (a port's off-by-one in its reduction), so the weights no longer sum to 1."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    else:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), -torch.inf)
    e = torch.exp(scores)
    weights = e / (e[..., :-1].sum(-1, keepdim=True) if wrong else e.sum(-1, keepdim=True)).clamp_min(1e-30)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("opband_by_hand", _by_hand)
AttentionInterface.register("opband_by_hand_wrong", lambda *a, **k: _by_hand(*a, wrong=True, **k))


def _llama() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval(), "model.layers.0.self_attn"


def _gpt2() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).eval(), "transformer.h.0.attn"


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, str]]] = {"llama": _llama, "gpt2": _gpt2}
IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))


def _capture(model: torch.nn.Module, path: Path, attention: str | None = None) -> Path:
    if attention is not None:
        model.set_attn_implementation(attention)
    with torch.no_grad(), capture(model, path, level="aten", mode="summary", progress=False):
        model(IDS)
    return path


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_wrong_reimplementation_is_blamed_on_its_module(name: str, tmp_path: Path) -> None:
    model, changed = MODELS[name]()
    ref = _capture(model, tmp_path / "ref.bundle")
    tgt = _capture(MODELS[name]()[0], tmp_path / "tgt.bundle", "opband_by_hand_wrong")
    report = accuracy.compare(ref, tgt)
    fd = report.first_divergence
    assert fd is not None and report.verdict == Verdict.FAIL
    assert fd.module == changed and fd.kind == "module", (fd.id, fd.reason)
    assert "implementation of module" in (fd.finding or "")
    assert any(u.implementation_differs for u in report.unmatched if u.record.module == changed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_faithful_reimplementation_passes(name: str, tmp_path: Path) -> None:
    model, changed = MODELS[name]()
    ref = _capture(model, tmp_path / "ref.bundle")
    tgt = _capture(MODELS[name]()[0], tmp_path / "tgt.bundle", "opband_by_hand")
    report = accuracy.compare(ref, tgt)
    assert report.counts[Verdict.FAIL] == 0 and report.counts[Verdict.WARN] == 0, report.first_divergence
    assert any(u.implementation_differs for u in report.unmatched if u.record.module == changed)
