"""The GEMM-like modules of a model: what a quantizing variant replaces, and what it leaves alone.

A GEMM-like module multiplies its input by a weight matrix: ``nn.Linear`` (and subclasses),
``transformers``' ``Conv1D`` (GPT-2, GPT-J style: weight stored ``[in, out]``), the packed
projections of ``nn.MultiheadAttention``, convolutions, ``nn.Bilinear`` and linear layers of
other libraries. Each is either a :class:`Gemm` (its weight as ``[out, in]`` and bias, ready to
be replaced at the same path) or a :class:`LeftAlone` with the reason it is not replaced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Module packages whose layers are already quantized or fake-quantized (a model brought quantized).
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.ao.nn.qat", "torch.ao.nn.intrinsic", "torchao.")


@dataclass(frozen=True)
class Gemm:
    """A replaceable GEMM-like module: ``y = x @ weight.T + bias``."""

    name: str
    kind: str
    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None


@dataclass(frozen=True)
class LeftAlone:
    """A GEMM-like module a variant does not replace, and why."""

    name: str
    kind: str
    reason: str


def is_conv1d_transformers(m: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D``: a Linear with a transposed ``[in, out]`` weight."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None \
        and m.weight.dim() == 2


def already_quantized(m: nn.Module) -> bool:
    """A module of a quantization library, or one of opband's own replacements."""
    mod = type(m).__module__ or ""
    return (mod.startswith(_QUANTIZED_PACKAGES) or hasattr(m, "weight_fake_quant")
            or bool(getattr(m, "opband_quantized", False)))


def find_gemms(model: nn.Module) -> tuple[list[Gemm], list[LeftAlone]]:
    """Every GEMM-like module of ``model`` in ``named_modules`` order, as replaceable or left alone."""
    gemms: list[Gemm] = []
    left: list[LeftAlone] = []
    mha_out = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    for name, m in model.named_modules():
        kind = type(m).__name__
        if already_quantized(m):
            if _has_matrix(m) or isinstance(m, nn.Linear):
                left.append(LeftAlone(name, kind, f"already quantized ({type(m).__module__}.{kind})"))
        elif id(m) in mha_out:
            left.append(LeftAlone(name, kind, "nn.MultiheadAttention reads out_proj.weight directly "
                                              "(F.multi_head_attention_forward), never calling the module"))
        elif isinstance(m, nn.Linear):
            if isinstance(m.weight, nn.parameter.UninitializedParameter):
                left.append(LeftAlone(name, kind, "LazyLinear not initialized yet: run the model once first"))
            else:
                gemms.append(Gemm(name, kind, m.weight, m.bias))
        elif is_conv1d_transformers(m):
            gemms.append(Gemm(name, kind, m.weight.t(), m.bias))
        elif isinstance(m, nn.MultiheadAttention):
            left.append(LeftAlone(name, kind, "packed q/k/v projection (in_proj_weight) runs inside "
                                              "F.multi_head_attention_forward, not as a module"))
        elif isinstance(m, nn.modules.conv._ConvNd):
            left.append(LeftAlone(name, kind, "convolution: the variants quantize matrix multiplications only "
                                              "(torch has no dynamic INT8 or FP8 convolution kernel)"))
        elif isinstance(m, nn.Bilinear):
            left.append(LeftAlone(name, kind, "bilinear form: no quantized kernel"))
        elif kind.endswith("Linear") and _has_matrix(m):
            left.append(LeftAlone(name, kind, f"unknown linear layer type {type(m).__module__}.{kind}: its forward "
                                              "is not known, so it is not replaced"))
    return gemms, left


def _has_matrix(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    if callable(w) and not isinstance(w, torch.Tensor):
        try:
            w = w()  # torch.ao dynamic Linear: weight() unpacks
        except Exception:  # noqa: BLE001
            return True
    return isinstance(w, torch.Tensor) and w.dim() == 2


def set_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at path ``name`` (``""`` is the root: the new module is returned instead)."""
    if not name:
        return new
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)
    return model


def coverage(variant: str, replaced: list[Gemm], left: list[LeftAlone]) -> dict[str, Any]:
    """What a variant did, for the manifest (``run["variant_coverage"]``) and the CLI."""
    found = Counter(g.kind for g in replaced) + Counter(x.kind for x in left)
    done = Counter(g.kind for g in replaced)
    return {
        "variant": variant,
        "gemm_modules": len(replaced) + len(left),
        "replaced": len(replaced),
        "by_type": {k: {"found": n, "replaced": done.get(k, 0)} for k, n in sorted(found.items())},
        "replaced_names": [g.name for g in replaced],
        "left_alone": [{"name": x.name, "type": x.kind, "reason": x.reason} for x in left],
    }


def describe(cov: dict[str, Any], limit: int = 8) -> list[str]:
    """Lines for the terminal: ``int8 replaced 9 of 9 GEMM-like modules (Conv1D 8/8, Linear 1/1)``."""
    types = ", ".join(f"{k} {v['replaced']}/{v['found']}" for k, v in cov["by_type"].items())
    lines = [f"{cov['variant']} replaced {cov['replaced']} of {cov['gemm_modules']} GEMM-like modules"
             + (f" ({types})" if types else "")]
    left = cov["left_alone"]
    for x in left[:limit]:
        lines.append(f"  left alone: {x['name'] or '(root)'} ({x['type']}): {x['reason']}")
    if len(left) > limit:
        lines.append(f"  ... and {len(left) - limit} more left alone (manifest run.variant_coverage.left_alone)")
    return lines
