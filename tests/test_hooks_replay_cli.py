"""Replay says what it does: no SPEC it would ignore, fused attention replayed, and what it could
not replay listed with the reason on the terminal."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import accuracy
from accuracy.bundle import Bundle
from hooks import capture, replay

SPECS = str(Path(__file__).parent / "transformers_specs.py")


class AttnDrop(nn.Module):
    """Fused attention (SDPA, no dropout: deterministic) and a dropout in train mode (random)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.drop(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_fused_attention_replays_and_random_ops_are_listed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AttnDrop()
    model.drop.train()
    with torch.no_grad(), capture(model, tmp_path / "ref.bundle", inputs=True, progress=False) as cap:
        model(torch.randn(2, 8, 16))
    ref = Bundle.open(cap.bundle_path)  # type: ignore[arg-type]
    sdpa = [r for r in ref.records if "scaled_dot_product" in r.op]
    assert sdpa and sdpa[0].input_tensors and all(sdpa[0].input_tensors)
    out = replay(ref.path, None, tmp_path / "rp.bundle")
    rp = Bundle.open(out)
    assert {r.op for r in rp.records} >= {sdpa[0].op}
    report = accuracy.compare(ref, rp, mode="replay")
    att = next(o for o in report.ops if o.op == sdpa[0].op and o.output == 0)
    assert att.metrics is not None and att.metrics.max_abs == 0  # fp32 replay on CPU: bit for bit
    msgs = [(d.key, d.message) for d in ref.manifest.diagnostics]
    assert any(k and "drop" in k and "draws random numbers" in m for k, m in msgs)


def test_cli_replay_takes_no_spec_and_lists_what_it_did_not_replay(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    opband = str(Path(sys.executable).parent / "opband")
    spec = tmp_path / "m.py"
    spec.write_text(
        "import torch\nfrom torch import nn\n"
        "class D(nn.Module):\n"
        "    def forward(self, x): return nn.functional.dropout(x, 0.5, training=True)  # random even in eval\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.l = nn.Linear(4, 4); self.d = D()\n"
        "    def forward(self, x): return self.d(self.l(x))\n"
        "def build():\n    torch.manual_seed(0); return M(), (torch.randn(3, 4),)\n")
    ref = tmp_path / "ref.bundle"
    r = subprocess.run([opband, "capture", f"{spec}:build", "-o", str(ref), "--inputs"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([opband, "capture", "--replay", str(ref), "-o", str(tmp_path / "rp.bundle")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "not replayed: 1 op: the op draws random numbers (d/aten.bernoulli_#0)" in r.stdout


def test_gpt2_sdpa_replays(tmp_path: Path) -> None:
    """transformers' GPT-2 runs the fused CPU flash attention kernel; it used to be refused as random."""
    pytest.importorskip("transformers")
    from hooks import run_capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = run_capture(f"{SPECS}:gpt2", tmp_path / "ref.bundle", device="cpu", inputs=True, progress=False)
    b = Bundle.open(ref)
    assert not b.manifest.diagnostics
    rp = Bundle.open(replay(ref, None, tmp_path / "rp.bundle"))
    assert not rp.manifest.diagnostics
    fused = {r.key for r in rp.records if "flash_attention" in r.op}
    assert len(fused) == 2  # one per layer
