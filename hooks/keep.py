"""Keep some modules of a low-precision model at the reference precision.

A kept module is the reference's own module (an fp32 copy taken before the variant was applied, or
the module at the same path of a reference model) put back at its path in the target model. Its
floating inputs are cast up to its parameters' dtype as they arrive, and its floating outputs cast
back to the dtype the first floating input arrived in, so the modules around it see what they would
see without it (the way TensorRT and Polygraphy keep a layer in fp32). Keeping a module keeps
everything inside it; a path inside another kept path adds nothing.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from hooks import gemm


class KeepError(ValueError):
    """A module path to keep that the model does not have (the message lists near ones)."""


def normalize(paths: Iterable[str]) -> list[str]:
    """The paths without repeats and without any path inside another one given, in the order given."""
    given = list(dict.fromkeys(paths))
    out: list[str] = []
    for p in given:
        if any(inside(p, q) for q in given if q != p):
            continue
        out.append(p)
    return out


def inside(path: str, outer: str) -> bool:
    """``path`` is ``outer`` itself or a module within it."""
    return path == outer or outer == "" or path.startswith(outer + ".")


#: dtypes a module computes in (fp8 storage and integer weights are not: such a module takes its inputs in
#: the activations' dtype)
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of a module's first floating parameter or buffer that it computes in (None: it has none)."""
    for t in (*module.parameters(), *module.buffers()):
        if t.dtype in COMPUTE_DTYPES:
            return t.dtype
    return None


def check_paths(model: nn.Module, paths: Sequence[str]) -> None:
    """Raise :class:`KeepError` for a path that is not a module of ``model`` (or is its root)."""
    names = {n for n, _ in model.named_modules()}
    for p in paths:
        if not p:
            raise KeepError("keeping the root module keeps the whole model: nothing would run at the variant's "
                            "precision; name the modules inside it to keep")
        if p not in names:
            near = sorted(n for n in names if n and (n.endswith(p.rsplit(".", 1)[-1]) or p.startswith(n + ".")))[:6]
            raise KeepError(f"keep: the model has no module {p!r}" + (f"; near ones: {near}" if near else "")
                            + " (paths as model.named_modules() spells them)")


@dataclass
class KeptModules:
    """Reference modules swapped into a target model at their paths; :meth:`restore` undoes it."""

    target: nn.Module
    swapped: dict[str, nn.Module] = field(default_factory=dict)  # path -> the target's own module
    handles: list[Any] = field(default_factory=list)

    def restore(self) -> None:
        for h in self.handles:
            h.remove()
        for path, own in self.swapped.items():
            gemm.set_module(self.target, path, own)
        self.handles.clear()
        self.swapped.clear()


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype != dtype else t, x)


def _first_float_dtype(args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return None


def _device_of(module: nn.Module) -> torch.device | None:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def _attach(module: nn.Module, replaced: torch.dtype | None, handles: list[Any]) -> None:
    """Cast a kept module's floating inputs to its own dtype, its outputs back to the dtype the module it
    replaced computes in (``replaced``), else to the dtype its first floating input arrived in."""
    own = compute_dtype(module) or torch.float32
    arrived: list[torch.dtype | None] = []

    def before(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        arrived.append(_first_float_dtype(args, kwargs))
        return _cast(args, own), _cast(kwargs, own)

    def after(mod: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        came = arrived.pop() if arrived else None
        dtype = replaced or came
        return _cast(output, dtype) if dtype is not None and dtype != own else output

    handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
    handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))


def keep_modules(target: nn.Module, originals: dict[str, nn.Module], paths: Sequence[str]) -> KeptModules:
    """Put ``originals[path]`` (reference-precision modules) at each of ``paths`` in ``target``, with the
    casts at their boundaries; returns what :meth:`KeptModules.restore` puts back."""
    kept = KeptModules(target)
    for path in normalize(paths):
        kept.swapped[path] = own = target.get_submodule(path)
        module = originals[path]
        device = _device_of(own)
        if device is not None:
            module.to(device)
        gemm.set_module(target, path, module)
        _attach(module, compute_dtype(own), kept.handles)
    return kept


def reference_copies(model: nn.Module, paths: Sequence[str]) -> dict[str, nn.Module]:
    """Deep copies of the modules at ``paths`` (taken before a variant changes the model in place)."""
    check_paths(model, paths)
    return {p: copy.deepcopy(model.get_submodule(p)) for p in normalize(paths)}


def read_keep_file(path: str | os.PathLike[str], variant: str) -> list[str]:
    """The module paths of a keep file (TOML, YAML or JSON, as ``opband prescribe`` writes it:
    ``variant = "int8"`` and ``keep = ["model.layers.1.mlp.down_proj"]``); a ``variant`` in the file must be
    the one the capture runs."""
    from accuracy.budgets import load_config
    from accuracy.errors import ConfigError

    config = load_config(path, "keep file")
    if not isinstance(config, Mapping):
        raise ConfigError(f"keep file {path}: a table with a 'keep' list, e.g. keep = [\"model.layers.1.mlp\"]")
    unknown = set(config) - {"keep", "variant"}
    if unknown:
        raise ConfigError(f"keep file {path}: unknown field(s) {sorted(unknown)}; it holds 'keep' and 'variant'")
    paths = config.get("keep")
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"keep file {path}: 'keep' must be a list of module paths, e.g. keep = [\"model.layers.1.mlp\"]")
    named = config.get("variant")
    if named is not None and named != variant:
        raise ConfigError(f"keep file {path} was prescribed for --variant {named}, not {variant}: pass --variant {named} "
                          f"or prescribe again for {variant} (opband prescribe SPEC --variant {variant})")
    return list(paths)
