"""Capture real torch.nn architectures (beyond the Llama-style demo) at every level, in full mode.

Architectures: a CNN (Conv2d, BatchNorm2d, in-place ReLU, MaxPool2d, AdaptiveAvgPool2d, Linear), a
2-layer batch-first LSTM and a GRU with Linear heads, nn.TransformerEncoder (2 layers, batch first,
eval) without and with a padding mask (the mask makes its fast path run on nested tensors), an
EmbeddingBag + LayerNorm + GELU MLP, a depthwise-separable Conv1d block with GroupNorm and SiLU,
and a residual model (``x = x + block(x)``, ``x += block(x)`` on a recorded module output,
``torch.chunk``, ``torch.cat``).

For each architecture and level: capture does not change the output bit for bit (at ``api`` level,
where docs/intrusiveness.md says the TorchFunctionMode turns off the transformer fast path, the
output is bit for bit that of the composite path, and the manifest lists the fast path); the
bundle has exactly the expected diagnostics (none, or the documented ``skipped: nested tensors``);
every module call that ran has its records, each holding exactly the values the module returned
(the root's record is the model output); every record's statistics describe its stored values;
the residual model's own ops hold their values at the time they ran. Architectures with
``nn.Linear`` are also captured as the ``int8`` variant, whose module record keys (and the op keys
of every module int8 does not replace) must be those of the fp32 capture.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from accuracy.bundle import Bundle
from hooks import capture
from hooks.capture import LEVELS
from hooks.intrusive import INTRUSIVE, intrusive_ops
from hooks.variants import apply_variant

FAST_PATH = "nn.TransformerEncoderLayer (fast path)"
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")


# -- architectures ------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """torchvision style: the first ReLU works in place on BatchNorm's (already recorded) output."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class RNNHead(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], layers: int) -> None:
        super().__init__()
        self.rnn = cell(12, 24, num_layers=layers, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class BagMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 32, mode="mean")
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.down = nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.norm(self.bag(ids, offsets)))))


class DepthwiseSeparable1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv1d(16, 16, 5, padding=2, groups=16)
        self.pointwise = nn.Conv1d(16, 32, 1)
        self.norm = nn.GroupNorm(4, 32)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.pointwise(self.depthwise(x))))


class Residual(nn.Module):
    """``x = x + block(x)``, an in-place ``x += block(x)`` on a module's output, cat and chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.block1 = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.gate = nn.Sigmoid()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = x + self.block1(x)
        a, b = torch.chunk(x, 2, dim=-1)
        x = torch.cat([a * self.gate(b), b], dim=-1)
        x = self.block2(x)
        x += self.block1(x)  # in place, on block2's recorded output, after it was recorded
        return self.head(x)


def _cnn() -> tuple[nn.Module, tuple[Any, ...]]:
    model = SmallCNN()
    with torch.no_grad():  # non-trivial running statistics, so eval-mode BatchNorm does something
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 16, 16),)


def _lstm() -> tuple[nn.Module, tuple[Any, ...]]:
    return RNNHead(nn.LSTM, 2), (torch.randn(3, 7, 12),)


def _gru() -> tuple[nn.Module, tuple[Any, ...]]:
    return RNNHead(nn.GRU, 1), (torch.randn(3, 7, 12),)


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder given a padding mask: in eval mode its fast path packs the batch into
    a nested tensor for the layers and pads it back at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=pad)


def _transformer() -> tuple[nn.Module, tuple[Any, ...]]:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.TransformerEncoder(layer, 2), (torch.randn(2, 10, 32),)


def _transformer_padded() -> tuple[nn.Module, tuple[Any, ...]]:
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 7:] = pad[1, 4:] = True
    return PaddedEncoder(), (torch.randn(2, 10, 32), pad)


def _bag() -> tuple[nn.Module, tuple[Any, ...]]:
    return BagMLP(), (torch.randint(0, 100, (20,)), torch.tensor([0, 3, 9, 15]))


def _depthwise() -> tuple[nn.Module, tuple[Any, ...]]:
    return DepthwiseSeparable1d(), (torch.randn(2, 16, 20),)


def _residual() -> tuple[nn.Module, tuple[Any, ...]]:
    return Residual(), (torch.randn(4, 6, 16),)


ARCHS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "cnn": _cnn, "lstm": _lstm, "gru": _gru, "transformer": _transformer, "transformer_padded": _transformer_padded,
    "embeddingbag": _bag,
    "depthwise_conv1d": _depthwise, "residual": _residual,
}
WITH_LINEAR = [name for name in ARCHS if name != "depthwise_conv1d"]
TRANSFORMERS = ("transformer", "transformer_padded")

# Where the fused fast path runs (module and aten level, and plain): which modules run at all
# (TransformerEncoderLayer's submodules never do) ...
FUSED_RAN = {"transformer": {"", "layers.0", "layers.1"},
             "transformer_padded": {"", "enc", "enc.layers.0", "enc.layers.1"}}
# ... and which calls output a nested tensor, which docs/capture.md says is skipped with a diagnostic.
NESTED = "skipped: nested tensors are not captured"
EXPECTED_DIAGNOSTICS: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("transformer_padded", "module"): [("enc.layers.0/forward#0", NESTED), ("enc.layers.1/forward#0", NESTED)],
    ("transformer_padded", "aten"): [
        ("enc/aten._nested_tensor_from_mask#0", NESTED),
        ("enc.layers.0/aten._transformer_encoder_layer_fwd#0", NESTED), ("enc.layers.0/forward#0", NESTED),
        ("enc.layers.1/aten._transformer_encoder_layer_fwd#0", NESTED), ("enc.layers.1/forward#0", NESTED),
    ],
}


def build(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model, inputs = ARCHS[name]()
    return model.eval(), inputs


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@contextmanager
def _mha_fastpath(enabled: bool) -> Iterator[None]:
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def _identical(a: Any, b: Any) -> bool:
    """Bitwise equal (NaN-aware), with dtype and shape."""
    la, lb = tree_leaves(a), tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x, y) and not (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                          and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))):
            return False
    return True


def _plain(model: nn.Module, inputs: tuple[Any, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs)


class Reference:
    """An uncaptured run with our own module hooks: record id -> a copy of each module output."""

    def __init__(self, out: torch.Tensor, values: dict[str, np.ndarray], nested: list[str]) -> None:
        self.out, self.values, self.nested = out, values, nested

    @property
    def ran(self) -> set[str]:
        return {i.split("/", 1)[0] for i in [*self.values, *self.nested]}


def _reference(model: nn.Module, inputs: tuple[Any, ...]) -> Reference:
    names = {id(m): n for n, m in model.named_modules()}
    calls: dict[str, int] = defaultdict(int)
    seen: dict[str, np.ndarray] = {}
    nested: list[str] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        key = f"{name}/forward#{calls[name]}"
        calls[name] += 1
        for i, t in enumerate(t for t in tree_leaves(output) if isinstance(t, torch.Tensor)):
            rid = key if i == 0 else f"{key}:{i}"
            if t.is_nested:
                nested.append(rid)
            else:
                seen[rid] = t.detach().clone().numpy()

    # A global hook, as capture uses: per-module hooks turn off TransformerEncoderLayer's fast path.
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        out = _plain(model, inputs)
    finally:
        handle.remove()
    return Reference(out, seen, nested)


def _capture(model: nn.Module, inputs: tuple[Any, ...], path: Path, level: str) -> tuple[torch.Tensor, Bundle]:
    with torch.no_grad(), capture(model, path, level=level, mode="full", progress=False) as cap:
        out = model(*inputs)
    assert cap.bundle_path is not None
    return out, Bundle.open(cap.bundle_path)


def _check_stats(bundle: Bundle) -> None:
    """Every record's statistics describe the values stored for it (full mode stores both).

    min/max/counts/sample exactly; mean, std and l2 to float32 accumulation error (the CPU kernel
    sums blocks of 2048 values in float32, accuracy/fused.py), relative to the values' magnitude."""
    for r in bundle.records:
        where = f"{r.id} ({r.kind})"
        vals = bundle.record_values(r.id)
        assert vals is not None and list(vals.shape) == r.shape, where
        if vals.size == 0:  # e.g. native_batch_norm's save_mean/save_invstd in eval mode
            assert r.stats is None, where
            continue
        assert r.stats is not None and r.stats.numel == vals.size, where
        v = vals.astype(np.float64).reshape(-1)
        finite = v[np.isfinite(v)]
        assert (r.stats.nan, r.stats.inf) == (int(np.isnan(v).sum()), int(np.isinf(v).sum())), where
        assert r.stats.min == finite.min() and r.stats.max == finite.max(), where
        assert r.stats.absmax == np.abs(finite).max() and r.stats.zeros == int((v == 0).sum()), where
        scale = float(np.sqrt(np.square(finite).mean()))
        assert r.stats.mean == pytest.approx(finite.mean(), rel=0, abs=1e-6 * scale + 1e-30), where
        assert r.stats.std == pytest.approx(finite.std(), rel=0, abs=1e-5 * scale + 1e-30), where
        assert r.stats.l2 == pytest.approx(np.sqrt(np.square(finite).sum()), rel=1e-6), where
        idx = torch.linspace(0, v.size - 1, min(16, v.size)).round().long().numpy()
        assert r.stats.sample == v[idx].tolist(), where


def _check_residual_ops(b: Bundle, level: str, ref: dict[str, np.ndarray]) -> None:
    """The root's own ops hold their values as computed then, the in-place add after it ran."""
    op = {"api": {"add": "torch.Tensor.add", "mul": "torch.Tensor.mul", "cat": "torch.cat", "iadd": "torch.Tensor.add_",
                  "chunk": "torch.chunk"},
          "aten": {"add": "aten.add", "mul": "aten.mul", "cat": "aten.cat", "iadd": "aten.add_",
                   "chunk": "aten.split"}}[level]
    assert [r.id for r in b.records if r.module == "" and r.kind == level] == [
        f"/{op[k]}#0" for k in ("add", "mul", "cat", "iadd")]
    assert b.manifest.skipped_ops.get(op["chunk"]) == 1  # chunk only makes views: skipped, counted
    add = ref["proj/forward#0"] + ref["block1/forward#0"]
    mul = add[..., :16] * ref["gate/forward#0"]
    expected = {"add": add, "mul": mul, "cat": np.concatenate([mul, add[..., 16:]], -1),
                "iadd": ref["block2/forward#0"] + ref["block1/forward#1"]}
    for k, want in expected.items():
        np.testing.assert_array_equal(b.record_values(f"/{op[k]}#0"), want, err_msg=f"{level} {k}", strict=True)


def _leaves(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if n and next(m.children(), None) is None}


def _module_ids(bundle: Bundle) -> list[str]:
    return [r.id for r in bundle.records if r.kind == "module"]


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_capture(arch: str, level: str, tmp_path: Path) -> None:
    model, inputs = build(arch)
    expected = _plain(model, inputs)
    assert _identical(_plain(model, inputs), expected), "the plain run itself is not deterministic"
    fused_off = arch in TRANSFORMERS and level == "api"
    if fused_off:
        # docs/intrusiveness.md: a TorchFunctionMode makes has_torch_function true, so the fused
        # inference path is skipped for the composite one. The capture must then compute exactly
        # what the composite path computes, and the manifest must say so.
        assert FAST_PATH in INTRUSIVE["api"]
        with _mha_fastpath(False):
            ref = _reference(model, inputs)
        if arch == "transformer":
            torch.testing.assert_close(ref.out, expected, rtol=1e-5, atol=1e-5)
        else:  # padded positions: 0 from the nested path, computed values from the composite one
            keep = ~inputs[1]
            torch.testing.assert_close(ref.out[keep], expected[keep], rtol=1e-5, atol=1e-5)
            assert not torch.equal(ref.out[~keep], expected[~keep]) and not expected[~keep].any()
    else:
        ref = _reference(model, inputs)
        assert _identical(ref.out, expected), "the reference hooks changed the output"

    out, b = _capture(model, inputs, tmp_path / f"{arch}-{level}.bundle", level)

    # 1. non-intrusive (or exactly the documented fallback path)
    assert _identical(out, ref.out), f"{arch} at {level}: capture changed the output"
    assert b.manifest.run["intrusive_ops"] == intrusive_ops(level)
    assert (FAST_PATH in b.manifest.run["intrusive_ops"]) == (level == "api")

    # 2. the bundle: only the expected diagnostics, every module call recorded with its exact values
    assert b.manifest.run["level"] == level and b.manifest.run["mode"] == "full"
    diagnostics = [(d.key, d.message) for d in b.manifest.diagnostics]
    assert diagnostics == EXPECTED_DIAGNOSTICS.get((arch, level), [])
    assert [k for k, _ in diagnostics if k.endswith("/forward#0")] == ref.nested
    ids = _module_ids(b)
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(ref.values), f"{arch} at {level}: module records differ from the modules that ran"
    if arch in FUSED_RAN and not fused_off:
        assert ref.ran == FUSED_RAN[arch]  # the fused path runs whole layers in one kernel
    else:
        # MultiheadAttention reads out_proj's parameters, never calls it
        unused = {n for n in _leaves(model) if n.endswith("self_attn.out_proj")}
        assert _leaves(model) - ref.ran == unused, _leaves(model) - ref.ran
        assert len(unused) == (2 if arch in TRANSFORMERS else 0)
    for rid, want in ref.values.items():
        got = b.record_values(rid)
        assert got is not None, rid
        np.testing.assert_array_equal(got, want, err_msg=f"{arch} at {level}: {rid}", strict=True)
    root = b.record("/forward#0")
    assert root.module == "" and root.kind == "module"
    np.testing.assert_array_equal(b.record_values("/forward#0"), out.numpy(), strict=True)
    _check_stats(b)
    if arch == "residual" and level != "module":
        _check_residual_ops(b, level, ref.values)
    kinds = {r.kind for r in b.records}
    assert kinds == ({"module"} if level == "module" else {"module", level})


def _linear_paths(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def _check_int8_keys(model: nn.Module, inputs: tuple[Any, ...], level: str, tmp_path: Path,
                     diagnostics: list[tuple[str, str]]) -> None:
    linears = _linear_paths(model)
    assert linears
    _, ref = _capture(model, inputs, tmp_path / "fp32.bundle", level)
    assert [(d.key, d.message) for d in ref.manifest.diagnostics] == diagnostics
    q_model, q_inputs, notes = apply_variant(model, inputs, "int8", "cpu", allow_partial=True)  # CNN: convs stay
    assert notes["variant"] == "int8"
    quantized = {n for n, m in q_model.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)}
    assert quantized == linears
    expected = _plain(q_model, q_inputs)
    out, q = _capture(q_model, q_inputs, tmp_path / "int8.bundle", level)
    assert _identical(out, expected), f"int8 at {level}: capture changed the output"
    assert [(d.key, d.message) for d in q.manifest.diagnostics] == diagnostics
    # module records: same ids (module path, call ordinal, output index) and shapes
    fp32_mod = [(r.id, r.shape) for r in ref.records if r.kind == "module"]
    assert fp32_mod and [(r.id, r.shape) for r in q.records if r.kind == "module"] == fp32_mod
    # op keys at every module are those of fp32, except inside the Linears int8 replaced
    # (their kernels are quantized ones by design)
    def by_module(b: Bundle) -> dict[str, list[str]]:
        keys: dict[str, list[str]] = defaultdict(list)
        for r in b.records:
            if r.kind == "module" or r.module not in linears:
                keys[r.module].append(r.id)
        return dict(keys)

    assert by_module(q) == by_module(ref)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", [a for a in WITH_LINEAR if a not in TRANSFORMERS])
def test_int8_variant_same_module_keys(arch: str, level: str, tmp_path: Path) -> None:
    model, inputs = build(arch)
    _check_int8_keys(model, inputs, level, tmp_path, EXPECTED_DIAGNOSTICS.get((arch, level), []))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", TRANSFORMERS)
def test_int8_transformer_keys_without_fast_path(arch: str, level: str, tmp_path: Path) -> None:
    """With torch's MHA/encoder fast path switched off, the int8 transformer runs and keeps its keys."""
    model, inputs = build(arch)
    with _mha_fastpath(False):  # no nested tensors either: no diagnostics
        _check_int8_keys(model, inputs, level, tmp_path, [])


@pytest.mark.parametrize("variant", ["int8", "fp8-e4m3"])
@pytest.mark.parametrize("arch", TRANSFORMERS)
def test_variant_transformers_run_their_replaced_linears(arch: str, variant: str) -> None:
    """torch's fused encoder/attention fast path reads Linear weights directly: it crashed on int8's
    dynamic-quantized Linear (``weight`` is a method) and silently skipped the FP8 emulation (the fp8
    output was bitwise the fp32 one). The variant switches it off inside those modules only."""
    model, inputs = build(arch)
    expected = _plain(model, inputs)  # fp32 with the fast path
    q_model, q_inputs, notes = apply_variant(model, inputs, variant, "cpu")
    assert "mha_fastpath" in notes and torch.backends.mha.get_fastpath_enabled()
    out = _plain(q_model, q_inputs)
    assert torch.backends.mha.get_fastpath_enabled(), "restored after the forward"
    assert not torch.equal(out, expected) and torch.isfinite(out).all()
    real = expected.abs().amax(-1) > 0  # the nested-tensor fast path zeroes padded positions; the composite does not
    assert (out - expected)[real].abs().max() < 0.5 * expected.abs().max()  # quantized, not broken
