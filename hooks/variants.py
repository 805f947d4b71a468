"""Target variants: the same model code run in another precision or with real INT8 kernels.

Module paths stay those of the fp32 model (a quantized or FP8 Linear replaces Linear at the same
path). FP8 is emulated (quantize-dequantize around an fp32 matmul), which the run notes say.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from hooks import fp8

VARIANTS = ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp8-e5m2")
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


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


def apply_variant(model: nn.Module, inputs: Any, variant: str, device: str) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Return (model, inputs, notes) for ``variant`` on ``device``; notes go into the manifest.

    Like ``Module.to``, this may change ``model`` in place (casts, FP8 Linears); int8 returns a
    quantized copy."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    notes: dict[str, Any] = {"variant": variant}
    if variant == "int8":
        if torch.device(device).type != "cpu":
            raise ValueError("int8 uses torch's dynamic quantization kernels, which run on cpu only: pass --device cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import quantize_dynamic

            model = quantize_dynamic(model.to("cpu"), {nn.Linear}, dtype=torch.qint8)
        notes.update(quantization="dynamic int8 (torch.ao quantize_dynamic of nn.Linear)",
                     quantized_engine=torch.backends.quantized.engine)
        _run_replaced_linears(model, notes)
        return model, _cast_inputs(inputs, None, "cpu"), notes
    if variant in fp8.FP8_DTYPES:
        model = fp8.convert(model.to(device), fp8.FP8_DTYPES[variant])
        notes.update(quantization=f"emulated {variant}: nn.Linear weights and inputs quantized to "
                     f"{fp8.FP8_DTYPES[variant]} with per-tensor amax scales, dequantized, fp32 matmul "
                     "(no FP8 kernels)", emulated=True)
        _run_replaced_linears(model, notes)
        return model, _cast_inputs(inputs, None, device), notes
    dtype = _CASTS.get(variant)
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    return model, _cast_inputs(inputs, dtype, device), notes
