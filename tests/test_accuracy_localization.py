"""Real captures of the demo decoder: injected faults are found and named, benign variation passes.

Faults are injected into one layer of the target model only (the reference is the same model
unchanged), then both are captured with ``hooks.capture`` and compared in propagated mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import accuracy  # noqa: E402
from accuracy import report  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.demo_model import build  # noqa: E402

Mutation = Callable[[nn.Module], None]


def _capture(path: Path, mutate: Mutation | None = None, level: str = "aten", threads: int | None = None) -> Path:
    model, inputs = build()
    if mutate is not None:
        mutate(model)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad(), capture(model, path, level=level, run={"variant": "fp32", "device": "cpu"}):
            model(*inputs)
    finally:
        torch.set_num_threads(old)
    return path


class PadeTanhSiLU(nn.Module):
    """SiLU through a Padé [3/2] tanh approximation: the kind of shortcut a fast kernel takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x / 2
        return x * 0.5 * (1 + (y * (27 + y * y) / (27 + 9 * y * y)).clamp(-1, 1))


class SplitK(nn.Module):
    """The same Linear as two half-K GEMMs summed: another summation order, same math."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1] // 2
        return x[..., :k] @ self.weight[:, :k].t() + x[..., k:] @ self.weight[:, k:].t()


def gelu_in_layer2(m: nn.Module) -> None:
    m.model.layers[2].mlp.act = nn.GELU()


def tanh_silu_in_layer1(m: nn.Module) -> None:
    m.model.layers[1].mlp.act = PadeTanhSiLU()


def rmsnorm_eps_in_layer1(m: nn.Module) -> None:
    m.model.layers[1].post_attention_layernorm.eps = 1e-4  # was 1e-6


def corrupt_one_weight_in_layer3(m: nn.Module) -> None:
    with torch.no_grad():
        m.model.layers[3].self_attn.v_proj.weight[5, 7] += 0.25


def sdpa_everywhere(m: nn.Module) -> None:
    for layer in m.model.layers:
        layer.self_attn.use_sdpa = True


def split_k_gemms(m: nn.Module) -> None:
    for layer in m.model.layers:
        layer.mlp.down_proj.forward = SplitK(layer.mlp.down_proj).forward
        layer.self_attn.o_proj.forward = SplitK(layer.self_attn.o_proj).forward


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("loc")
    return {level: _capture(out / f"ref-{level}.bundle", level=level) for level in ("aten", "module")}


FAULTS = [
    ("gelu", gelu_in_layer2, "model.layers.2.mlp.act"),
    ("tanh_silu", tanh_silu_in_layer1, "model.layers.1.mlp.act"),
    ("rmsnorm_eps", rmsnorm_eps_in_layer1, "model.layers.1.post_attention_layernorm"),
    ("weight", corrupt_one_weight_in_layer3, "model.layers.3.self_attn.v_proj"),
]


@pytest.mark.parametrize("level", ["aten", "module"])
@pytest.mark.parametrize("name,mutate,module", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_is_the_first_divergence(refs: dict[str, Path], tmp_path: Path, level: str, name: str,
                                       mutate: Mutation, module: str) -> None:
    target = _capture(tmp_path / f"{name}.bundle", mutate, level=level)
    rep = accuracy.compare(refs[level], target)
    assert rep.verdict == "fail" and not rep
    fd = rep.first_divergence
    assert fd is not None and fd.module == module, report.headline(rep)
    assert not fd.inherited and fd.verdict in ("fail", "warn")
    failing = [o for o in rep.ops if o.verdict in ("fail", "warn")]
    assert all(o.inherited for o in failing if o is not fd)  # everything downstream is marked inherited
    assert all(o.index >= fd.index for o in failing if o.kind == fd.kind)
    assert f"module {module}" in report.headline(rep)


BENIGN = [
    ("threads", None, 1, "aten"),
    ("threads_module", None, 1, "module"),
    ("sdpa", sdpa_everywhere, None, "module"),
    ("split_k_gemm", split_k_gemms, None, "module"),
]


@pytest.mark.parametrize("name,mutate,threads,level", BENIGN, ids=[b[0] for b in BENIGN])
def test_benign_variation_fails_nothing(refs: dict[str, Path], tmp_path: Path, name: str, mutate: Mutation | None,
                                        threads: int | None, level: str) -> None:
    target = _capture(tmp_path / f"{name}.bundle", mutate, level=level, threads=threads)
    rep = accuracy.compare(refs[level], target)
    assert rep.verdict == "pass", report.to_text(rep, limit=5)
    assert rep.first_divergence is None and rep.counts["fail"] == rep.counts["warn"] == 0
    assert len(rep.ops) == len(accuracy.Bundle.open(refs[level]).records)


def test_benign_variation_really_changes_numbers(refs: dict[str, Path], tmp_path: Path) -> None:
    """The benign cases are not vacuous: SDPA and split-K change the module outputs."""
    for mutate in (sdpa_everywhere, split_k_gemms):
        rep = accuracy.compare(refs["module"], _capture(tmp_path / "b.bundle", mutate, level="module"))
        assert max(o.error for o in rep.ops) > 1e-8


def test_replay_mode_marks_every_failure_local(refs: dict[str, Path], tmp_path: Path) -> None:
    rep = accuracy.compare(refs["module"], _capture(tmp_path / "g.bundle", gelu_in_layer2, level="module"),
                           mode="replay")
    assert rep.first_divergence is not None and rep.first_divergence.module == "model.layers.2.mlp.act"
    assert not any(o.inherited for o in rep.ops)
    from accuracy.report import headline

    assert "the target is an end-to-end run" in headline(rep)  # not a replay: upstream error is in each op's


def test_summary_bundles_localize_too(tmp_path: Path) -> None:
    """Summary mode (statistics and a 16-element sample, no tensors): the fault is still named."""
    def cap(path: Path, mutate: Mutation | None = None) -> Path:
        model, inputs = build()
        if mutate is not None:
            mutate(model)
        with torch.no_grad(), capture(model, path, level="module", mode="summary", run={"variant": "fp32"}):
            model(*inputs)
        return path

    ref = cap(tmp_path / "ref.bundle")
    assert accuracy.compare(ref, cap(tmp_path / "sdpa.bundle", sdpa_everywhere)).verdict == "pass"
    rep = accuracy.compare(ref, cap(tmp_path / "gelu.bundle", gelu_in_layer2))
    assert rep.first_divergence is not None and rep.first_divergence.module == "model.layers.2.mlp.act"
    assert rep.first_divergence.metrics is not None and rep.first_divergence.metrics.source == "summary"


def test_a_changed_attention_implementation_is_compared_at_the_module_boundary(refs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """SDPA (math backend: mul, bmm, _safe_softmax, bmm) where the reference ran bmm/div/softmax/bmm at
    aten level: the two bmm#0 hold scaled vs unscaled scores, so they are not paired; the attention
    module's output (equal to ~1e-7) is the comparison and nothing fails."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, inputs = build()
    sdpa_everywhere(model)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), capture(model, tmp_path / "sdpa.bundle",
                                                                  run={"variant": "fp32", "device": "cpu"}):
        model(*inputs)
    rep = accuracy.compare(refs["aten"], tmp_path / "sdpa.bundle")
    assert rep.counts["fail"] == rep.counts["warn"] == 0 and rep.first_divergence is None, report.headline(rep)
    by_id = {o.id: o for o in rep.ops}
    assert by_id["model.layers.0.self_attn/forward#0"].verdict == "pass"
    bmm = [u for u in rep.unmatched if u.record.key == "model.layers.0.self_attn/aten.bmm#0"]
    assert {u.side for u in bmm} == {"reference", "target"}
    assert all("implementation of module 'model.layers.0.self_attn' differs" in u.reason for u in bmm)
    assert by_id["model.layers.0.self_attn/aten.cat#0"].aligned_by == "key"  # the unchanged prefix still pairs
