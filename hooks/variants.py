"""Target variants: the same model code run in another precision or with real quantized kernels.

Casts (``fp16``, ``bf16``) convert the model and its floating inputs. Quantizing variants replace
every GEMM-like module (:mod:`hooks.gemm`: ``nn.Linear``, ``transformers`` ``Conv1D`` ...) at
the same module path with a module calling torch's real kernels (:mod:`hooks.quantize`,
:mod:`hooks.fp8`), and say in the run notes (``variant_coverage``) which modules they replaced
and which they left alone and why. A variant that replaces nothing, or fewer than half of the
GEMM-like modules, is refused unless ``allow_partial``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hooks import fp8, gemm, quantize
from hooks import keep as keep_mod

_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FP8 = {f"{name}{suffix}": (dtype, scaling) for name, dtype in fp8.FP8_DTYPES.items()
        for suffix, scaling in (("", "tensor"), ("-rowwise", "row"))}
#: Quantizing variants: (activation dtype the model is cast to or None, cpu only, description)
QUANTIZED: dict[str, tuple[torch.dtype | None, bool, str]] = {
    "int8": (None, True, "dynamic int8: per-token int8 activations, per-channel int8 weights "
                         "(torch.ao dynamic Linear, quantized::linear_dynamic)"),
    "w8a16": (torch.bfloat16, True, "weight-only int8 (symmetric, per output channel), bf16 activations "
                                    "(aten._weight_int8pack_mm)"),
    "w4a16": (torch.bfloat16, True, "weight-only int4 (asymmetric, groups of 128/64/32 inputs with a scale "
                                    "and zero each), bf16 activations (aten._weight_int4pack_mm_for_cpu)"),
    **{v: (None, False, f"{v.split('-rowwise')[0]}: weights and inputs cast to {dt} with "
                        f"{'per-row (per output channel / per token)' if sc == 'row' else 'per-tensor'} "
                        "amax scales, torch._scaled_mm")
       for v, (dt, sc) in _FP8.items()},
}
VARIANTS = ("fp32", "fp16", "bf16", *QUANTIZED)


class VariantCoverageError(ValueError):
    """A quantizing variant would leave the model (mostly) unquantized; the message says what it found."""


def _cast_inputs(inputs: Any, dtype: torch.dtype | None, device: str) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to(device)
            return x.to(dtype) if dtype is not None and x.is_floating_point() else x
        return x

    if isinstance(inputs, dict):
        return {k: conv(v) for k, v in inputs.items()}
    return tuple(conv(v) for v in inputs)


#: Modules with torch's fused inference fast path, which reads Linear weights directly instead of
#: calling the Linear modules: it would bypass a variant's replaced Linears (FP8 emulation silently
#: gave the fp32 result) and crashes on a dynamic-quantized Linear, whose ``weight`` is a method.
_FASTPATH_MODULES = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)


def _fastpath_off(module: nn.Module, args: Any) -> None:
    module.__dict__.setdefault("_opband_fastpath", []).append(torch.backends.mha.get_fastpath_enabled())
    torch.backends.mha.set_fastpath_enabled(False)


def _fastpath_restore(module: nn.Module, args: Any, output: Any) -> None:
    saved = module.__dict__.get("_opband_fastpath")
    if saved:
        torch.backends.mha.set_fastpath_enabled(saved.pop())


def _run_replaced_linears(model: nn.Module, notes: dict[str, Any]) -> None:
    """Make fast-path modules run their (replaced) Linear modules: the fast path is switched off
    while each runs, and restored after. Says so in the run notes when it applies."""
    hooked = [name for name, m in model.named_modules() if isinstance(m, _FASTPATH_MODULES)]
    for m in model.modules():
        if isinstance(m, _FASTPATH_MODULES):
            m.register_forward_pre_hook(_fastpath_off)
            m.register_forward_hook(_fastpath_restore, always_call=True)
    if hooked:
        notes["mha_fastpath"] = (f"off in {len(hooked)} transformer/attention modules, so that their Linear layers "
                                 "run as the variant replaced them (torch's fused path would read the weights)")


def _replacement(variant: str, g: gemm.Gemm) -> torch.nn.Module:
    if variant == "int8":
        return quantize.int8_dynamic(g)
    if variant == "w8a16":
        return quantize.W8A16Linear(g)
    if variant == "w4a16":
        return quantize.W4A16Linear(g)
    dtype, scaling = _FP8[variant]
    return fp8.FP8Linear(g, dtype, scaling)


def quantize_gemms(model: nn.Module, variant: str, device: str,
                   allow_partial: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """Replace every GEMM-like module :mod:`hooks.gemm` finds with ``variant``'s quantized module;
    returns the model and its coverage (:func:`hooks.gemm.coverage`). A module the kernel refuses
    (checked by one small forward) is left alone with the kernel's reason.

    Raises :class:`VariantCoverageError` when nothing, or fewer than half of the GEMM-like modules,
    would be replaced, unless ``allow_partial``."""
    act = QUANTIZED[variant][0]
    found, left = gemm.find_gemms(model)
    done: list[gemm.Gemm] = []
    new_model = model
    for g in found:
        try:
            with torch.no_grad():
                q = _replacement(variant, g).to(device)
                q(torch.zeros(1, g.weight.shape[1], dtype=act or g.weight.dtype, device=device))
        except Exception as e:  # noqa: BLE001 - a kernel's refusal becomes the module's reason
            left.append(gemm.LeftAlone(g.name, g.kind, f"{variant} kernel refused it: {type(e).__name__}: "
                                                       f"{str(e).splitlines()[0][:200]}"))
            continue
        new_model = gemm.set_module(new_model, g.name, q)
        done.append(g)
    cov = gemm.coverage(variant, done, left)
    if not allow_partial and (not done or 2 * len(done) < cov["gemm_modules"]):
        what = "changes nothing" if not done else "leaves most GEMM-like modules untouched"
        raise VariantCoverageError(
            f"--variant {variant} {what}: " + "\n".join(gemm.describe(cov, limit=12))
            + "\nA comparison would judge mostly unquantized numerics. Pass --allow-partial "
              "(allow_partial=True) to capture anyway")
    return new_model, cov


def apply(model: nn.Module, variant: str, keep: Sequence[str] = (), device: str = "cpu",
          allow_partial: bool = False) -> nn.Module:
    """``model`` in ``variant`` on ``device`` with the modules at ``keep`` (paths, as ``opband prescribe``
    names them) at the model's own precision (:mod:`hooks.keep`). Changes ``model`` in place, as
    ``Module.to`` does; cast the inputs to the variant's dtype yourself (fp16/bf16/w8a16/w4a16), or
    use :func:`apply_variant`, which returns them cast."""
    return apply_variant(model, (), variant, device, allow_partial, keep)[0]


def apply_variant(model: nn.Module, inputs: Any, variant: str, device: str,
                  allow_partial: bool = False, keep: Sequence[str] = ()) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Return (model, inputs, notes) for ``variant`` on ``device``; notes go into the manifest.

    Like ``Module.to``, this may change ``model`` in place (casts, replaced GEMM modules).
    Quantizing variants record ``notes["variant_coverage"]`` (see :func:`quantize_gemms`).
    ``keep``: module paths that stay at the model's own precision (``notes["kept"]``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    if keep:
        originals = keep_mod.reference_copies(model, list(keep))
        model, inputs, notes = apply_variant(model, inputs, variant, device, allow_partial)
        keep_mod.keep_modules(model, originals, list(originals))
        notes["kept"] = list(originals)
        return model, inputs, notes
    notes: dict[str, Any] = {"variant": variant}
    if variant in QUANTIZED:
        act, cpu_only, description = QUANTIZED[variant]
        if cpu_only and torch.device(device).type != "cpu":
            raise ValueError(f"{variant} uses torch's CPU kernels ({description}): pass --device cpu")
        model, cov = quantize_gemms(model.to(device), variant, device, allow_partial)
        if act is not None:
            model = model.to(act)
        notes.update(quantization=description, variant_coverage=cov)
        if variant == "int8":
            notes["quantized_engine"] = torch.backends.quantized.engine
        _run_replaced_linears(model, notes)
        return model, _cast_inputs(inputs, act, device), notes
    brought = [x for x in gemm.find_gemms(model)[1] if x.reason.startswith("already quantized")]
    if brought:  # a model quantized by another tool (torch.ao QAT, torchao): say so
        notes["quantized_by_model"] = {"modules": len(brought), "types": sorted({x.kind for x in brought})}
    dtype = _CASTS.get(variant)
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    return model, _cast_inputs(inputs, dtype, device), notes
