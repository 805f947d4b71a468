"""One capture run from a SPEC: load, apply the variant, run under capture, write the bundle."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from accuracy.manifest import RunNames
from hooks import devices
from hooks.capture import capture
from hooks.spec import UserCodeError, load_training_spec
from hooks.variants import QUANTIZED, apply_variant


def check_device(device: str) -> None:
    """Raise ValueError (the CLI prints ``error: ...``, exit 2) unless ``device`` names a device this
    torch build and machine have, instead of an AssertionError or RuntimeError deep inside torch."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        kind = device.split(":", 1)[0]
        if kind == "npu":
            raise ValueError("device npu needs Ascend's torch_npu installed (`import torch_npu` registers it); "
                             "pass --device cpu to capture here") from e
        raise ValueError(f"invalid device {device!r}: torch knows no device type {kind!r}. Use cpu, cuda, cuda:N, "
                         "mps, xpu, or an out-of-tree backend whose package is installed (npu: torch_npu)") from e
    if dev.type in ("cpu", "meta"):
        return
    mod = devices.backend_module(dev.type)
    is_available = getattr(mod, "is_available", None)
    if not callable(is_available):
        return  # a backend without the usual module: let torch report on it
    try:
        ok = bool(is_available())
    except Exception:  # noqa: BLE001 - a broken backend is an unavailable one
        ok = False
    if not ok:
        raise ValueError(f"device {device} is not available in this torch build/machine: pass --device cpu, "
                         "or install a CUDA/NPU build of torch")
    count = getattr(mod, "device_count", None)
    if dev.index is not None and callable(count):
        try:
            n = int(count())
        except Exception:  # noqa: BLE001
            return
        if dev.index >= n:
            raise ValueError(f"device {device} does not exist: this machine has {n} {dev.type} device(s)")


def run_capture(
    spec: str,
    out: str | os.PathLike[str],
    *,
    device: str | None = None,
    variant: str = "fp32",
    level: str = "aten",
    mode: str = "full",
    seed: int = 0,
    replay: str | os.PathLike[str] | None = None,
    golden: bool = False,
    names: RunNames | None = None,
    allow_partial: bool = False,
    compile: bool = False,  # noqa: A002 - the name users know from torch.compile
    train_steps: int | None = None,
    optimizer: str = "sgd",
    lr: float = 1e-3,
    generate: int | None = None,
    teacher_force: str | os.PathLike[str] | None = None,
    keep: Sequence[str] = (),
    **options: Any,
) -> Path:
    """Capture one forward pass of the SPEC's model and return the bundle path.

    With ``replay=REF_BUNDLE`` the model is not run: each ATen op of REF (captured with
    ``inputs=True``) is re-run alone on ``device``/``variant`` (``golden``: float64 on CPU).
    ``names`` (label, target name, tags) go into the manifest's ``run``. When the SPEC's function
    or the forward pass raises, no bundle is written and :class:`UserCodeError` says where.
    ``allow_partial``: capture a quantizing variant even when it leaves most GEMM-like modules alone.
    ``compile``: run each block through ``torch.compile`` (:func:`hooks.compiled.compile_blocks`);
    it is compiled by one forward before the captured one.
    ``backward=True`` (with ``train_steps``, default 1): run training steps instead of one forward
    (:func:`hooks.training.train_steps`; the SPEC may return a loss function as a third item).
    ``generate=N``: a greedy ``generate()`` of N tokens instead of one forward, each call of the model
    one step (:mod:`hooks.generation`); ``teacher_force=REF_BUNDLE`` makes each step choose the token
    the reference generation chose.
    ``keep``: module paths kept at the model's own precision inside the variant (``opband prescribe``).
    """
    named = names.model_dump(exclude_defaults=True) if names is not None else {}
    cpu_only = variant in QUANTIZED and QUANTIZED[variant][1]  # torch's int8/int4 kernels are CPU ones
    device = device or ("cpu" if cpu_only else devices.default_device())
    if not (replay is not None and golden):  # a golden replay runs on the CPU whatever ``device`` says
        check_device(device)
    if replay is not None:
        from hooks.replay import replay as replay_ops

        return replay_ops(replay, spec or None, out, device=device, variant=variant, golden=golden, mode=mode,
                          run=named)
    torch.manual_seed(seed)
    model, inputs, loss_fn = load_training_spec(spec)
    model, inputs, notes = apply_variant(model.eval(), inputs, variant, device, allow_partial, keep)
    if compile:
        from hooks.compiled import compile_blocks

        model, notes["compile"] = compile_blocks(model)
        with torch.no_grad():
            try:
                model(**inputs) if isinstance(inputs, dict) else model(*inputs)
            except Exception as e:
                raise UserCodeError("the compiled model's first (compiling) forward pass", e) from e
    run = {"spec": spec, "device": device, "seed": seed, **notes, **named}
    if options.get("backward"):
        from hooks.training import train_steps as run_steps

        with capture(model, out, level=level, mode=mode, run=run, **options) as cap:
            try:
                run.update(run_steps(model, inputs, cap, loss_fn, train_steps or 1, optimizer, lr))
            except Exception as e:
                cap.abort()  # a half-run is no capture: leave no bundle to upload by mistake
                raise UserCodeError("the training step", e) from e
    elif generate is not None:
        return _capture_generation(model, inputs, out, generate, teacher_force, level, mode, run, options)
    else:
        if train_steps is not None:
            raise ValueError("train_steps needs backward=True (--backward)")
        with torch.no_grad(), capture(model, out, level=level, mode=mode, run=run, **options) as cap:
            try:
                if isinstance(inputs, dict):
                    model(**inputs)
                else:
                    model(*inputs)
            except Exception as e:
                cap.abort()  # a half-run is no capture: leave no bundle to upload by mistake
                raise UserCodeError("the model's forward pass", e) from e
    assert cap.bundle_path is not None
    return cap.bundle_path


def _capture_generation(model: torch.nn.Module, inputs: Any, out: str | os.PathLike[str], new_tokens: int,
                        teacher_force: str | os.PathLike[str] | None, level: str, mode: str, run: dict[str, Any],
                        options: dict[str, Any]) -> Path:
    """``run_capture(generate=N)``: the greedy generation under capture, its tokens in ``run["generation"]``."""
    from accuracy.bundle import Bundle

    from hooks.generation import generate, reference_tokens

    if new_tokens < 1:
        raise ValueError("--generate needs at least 1 new token")
    teacher = None
    if teacher_force is not None:
        teacher = reference_tokens(Bundle.open(teacher_force).manifest.run, str(teacher_force))
        run["teacher_force"] = os.fspath(teacher_force)
    if not callable(getattr(model, "generate", None)):
        raise ValueError(f"--generate needs a model with a generate() method (a transformers model), not "
                         f"{type(model).__name__}")
    with torch.no_grad(), capture(model, out, level=level, mode=mode, run=run, call_steps=True, **options) as cap:
        try:
            run["generation"] = generate(model, inputs, new_tokens, teacher, cap.paused, cap.add_tensor)
        except ValueError:
            cap.abort()
            raise
        except Exception as e:
            cap.abort()  # a half-run is no capture: leave no bundle to upload by mistake
            raise UserCodeError("the model's generate()", e) from e
    assert cap.bundle_path is not None
    return cap.bundle_path

