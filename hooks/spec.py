"""Load a capture SPEC: ``package.module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """The SPEC cannot be loaded; the message says how to fix it."""


def load_spec(spec: str) -> tuple[Any, Any]:
    """Call the SPEC's function and return ``(model, example_inputs)``."""
    model, inputs, _ = load_training_spec(spec)
    return model, inputs


def load_training_spec(spec: str) -> tuple[Any, Any, Callable[[Any], Any] | None]:
    """``(model, example_inputs, loss_fn or None)``: a SPEC may return a third item, a function
    from the model's output to a scalar loss (for ``--backward``)."""
    fn = _resolve(spec)
    result = fn()
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise SpecError(f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn), "
                        f"got {type(result).__name__}")
    model, inputs, *rest = result
    loss_fn = rest[0] if rest else None
    if loss_fn is not None and not callable(loss_fn):
        raise SpecError(f"{spec}: the third item must be a loss function (output -> scalar tensor)")
    if not isinstance(inputs, (tuple, dict)):
        inputs = (inputs,)
    return model, inputs, loss_fn


def _resolve(spec: str) -> Callable[[], Any]:
    if ":" not in spec:
        raise SpecError(f"SPEC {spec!r} needs a ':function' part, e.g. mypkg.models:build or model.py:build")
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise SpecError(f"SPEC file {target} does not exist")
        mod_name = f"_opband_spec_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise SpecError(f"cannot import {target}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise SpecError(f"cannot import module {target!r}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SpecError(f"{target} has no function {name!r}")
    return fn
