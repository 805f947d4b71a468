"""Load a capture SPEC: ``package.module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """The SPEC cannot be loaded; the message says how to fix it."""


class UserCodeError(Exception):
    """The user's own code (the SPEC's build function or the model's forward pass) raised: the
    message is a few lines naming the exception and where in the user's code it happened."""

    def __init__(self, what: str, error: BaseException) -> None:
        self.error = error
        self.frames = user_frames(error)
        lines = [f"{what} raised {type(error).__name__}: {str(error).strip()[:1000]}"]
        for f in self.frames[-3:]:
            lines.append(f"  at {_short(f.filename)}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else ""))
        super().__init__("\n".join(lines))

    @property
    def location(self) -> str | None:
        """``file:line`` of the innermost frame in the user's code (None if there is none)."""
        return f"{_short(self.frames[-1].filename)}:{self.frames[-1].lineno}" if self.frames else None


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the user's code: the standard library, torch, and opband itself."""
    dirs = {sysconfig.get_paths()["stdlib"], str(Path(__file__).resolve().parent)}
    for name in ("torch", "accuracy", "typer", "click"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.add(str(Path(mod.__file__).resolve().parent))  # type: ignore[arg-type]
    return tuple(d + os.sep for d in dirs)


def user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``error``'s traceback that are in the user's code, outermost first."""
    skip = _library_dirs()
    return [f for f in traceback.extract_tb(error.__traceback__)
            if not str(Path(f.filename).resolve()).startswith(skip) and not f.filename.startswith("<")]


def _short(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def load_training_spec(spec: str) -> tuple[Any, Any, Callable[[Any], Any] | None]:
    """``(model, example_inputs, loss_fn or None)``: a SPEC may return a third item, a function
    from the model's output to a scalar loss (for ``--backward``)."""
    fn = _resolve(spec)
    try:
        result = fn()
    except Exception as e:
        raise UserCodeError(f"{spec}", e) from e
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
