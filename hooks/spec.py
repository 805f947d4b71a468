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
    fn = _resolve(spec)
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SpecError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    if not isinstance(inputs, (tuple, dict)):
        inputs = (inputs,)
    return model, inputs


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
