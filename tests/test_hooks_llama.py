"""A ``transformers`` Llama decoder (tiny config, random weights: nothing downloaded) through capture
and compare: the statistics kernel's rows against float64 formulas on the model's real outputs, the
output unchanged by capturing, and two fp32 runs comparing as identical."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from accuracy import compare  # noqa: E402
from accuracy.bundle import Bundle  # noqa: E402
from hooks import capture  # noqa: E402


def _tiny_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def test_llama_summary_statistics_and_identical_runs(tmp_path: Path) -> None:
    model, ids = _tiny_llama()
    with torch.no_grad():
        plain = model(ids).logits
        with capture(model, tmp_path / "a.bundle", mode="summary", progress=False):
            captured = model(ids).logits
        with capture(model, tmp_path / "b.bundle", mode="summary", progress=False):
            model(ids)
    assert torch.equal(plain, captured)  # capturing changes nothing the model computes
    bundle = Bundle.open(tmp_path / "a.bundle")
    records = bundle.records
    assert sum(r.kind == "aten" for r in records) > 50 and not bundle.manifest.diagnostics
    lm_head = next(r for r in records if r.key == "lm_head/forward#0")
    v = plain.double().reshape(-1)
    s = lm_head.stats
    assert s is not None and s.numel == v.numel() and s.nan == 0 and s.zeros == int((v == 0).sum())
    assert (s.min, s.max) == (float(v.min()), float(v.max()))  # exact: no rounding in a min or max
    assert s.mean == pytest.approx(float(v.mean()), abs=1e-6 * float(v.abs().max()))
    assert s.std == pytest.approx(float(v.std(unbiased=False)), rel=1e-6)
    assert s.l2 == pytest.approx(math.sqrt(float((v * v).sum())), rel=1e-6)
    report = compare(tmp_path / "a.bundle", tmp_path / "b.bundle")
    assert report.verdict == "pass" and report.counts["pass"] == len(records) and report.first_divergence is None
