"""``with capture(model, path): model(...)``: record module, API or ATen op outputs into a bundle.

Module level uses global forward hooks, looking each module's path up in ``model.named_modules()``,
so user code needs no changes. ``api`` adds a ``TorchFunctionMode`` (each top-level torch call);
``aten`` adds a ``TorchDispatchMode`` that sees every op after autograd, tagged with the innermost
module path. Recording never raises into the user's forward pass: a failure becomes a diagnostic
in the manifest. CPU tensors are written to the bundle as they are recorded (at the ``aten`` level by a
writer thread, drained before any op writes in place); accelerator tensors are copied to the host
(the model may mutate them in place later), buffered, and streamed to the bundle when the buffer fills.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from accuracy.manifest import Diagnostic, Fingerprints, Record
from hooks import distributed
from hooks.environment import environment
from hooks.composites import faithful_composites
from hooks.cudagraphs import refuse_cuda_graphs
from hooks.fingerprints import ParameterPrints, PendingPrints, launch_input_prints, parameter_prints
from hooks.intrusive import intrusive_ops
from hooks.modes import ApiMode, AtenMode, ModuleHooks
from hooks.observer import ObserverMode, cuda_device, why_not
from hooks.options import LEVELS, MODES, CaptureOptions
from hooks.recorder import Recorder

class capture:  # noqa: N801 - used as a context manager, reads like a function
    """Record a model's operators while the block runs; the bundle is written when it exits.

    >>> with capture(model, "run.bundle", level="aten", mode="full") as cap:
    ...     for batch in loader:
    ...         loss = model(batch).sum(); loss.backward(); cap.step()
    """

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike[str], **options: Any) -> None:
        self.model = model
        self.distributed = distributed.rank_info()
        self.path = distributed.rank_path(Path(path), self.distributed)  # one bundle per rank
        self.options = CaptureOptions(**options)
        self.options.validate()
        self.bundle_path: Path | None = None
        self._hooks: ModuleHooks | None = None
        self._mode: AtenMode | ApiMode | ObserverMode | None = None
        self.engine = ""  # how the aten level saw the ops: "observer" or "dispatch mode" (and why)
        self._recorder: Recorder | None = None
        self._prints = Fingerprints()
        self._weights: ParameterPrints | None = None  # parameter fingerprints still being walked
        self._inputs: PendingPrints | None = None  # the model inputs' prints, taken at its first call
        self._input_hook: Any = None
        self._composites: Any = None
        self._aborted = False
        self._calls = 0  # calls of the model so far (``call_steps``: each one is a step)
        self._step_hook: Any = None
        self._graphs: Any = None

    def __enter__(self) -> capture:
        rec = self._recorder = Recorder(self.path, self.options)
        self._prints = Fingerprints()
        self._inputs = None
        if self.options.fingerprints:
            self._fingerprint_model(rec)
        if self.options.call_steps:
            self._step_hook = self.model.register_forward_pre_hook(self._next_call)
        self._hooks = ModuleHooks(self.model, rec)
        if self.options.level == "aten":
            self._composites = faithful_composites()
            self._composites.__enter__()
            reason = why_not(self.options, self.model)
            if reason is None:
                self._mode = ObserverMode(rec, list(self._hooks.names.values()), cuda_device(self.model))
                self._hooks.observer = self._mode
                self.engine = "observer"
            else:
                self._mode = AtenMode(rec)
                self.engine = f"dispatch mode ({reason})"
        elif self.options.level == "api":
            self._mode = ApiMode(rec)
        if self._mode is not None:
            self._mode.__enter__()
        if not (isinstance(self._mode, ObserverMode) and self._mode.wrap_modules(self._hooks)):
            self._hooks.install()
        self._graphs = refuse_cuda_graphs()  # a graph replay would record nothing: refused with a sentence
        self._graphs.__enter__()
        return self

    def _fingerprint_model(self, rec: Recorder) -> None:
        """Parameters now (as loaded); inputs at the model's first call. Failures become diagnostics."""
        try:
            if self.options.level == "aten":  # its dispatch mode sees every in-place write: walk the weights meanwhile
                self._weights = ParameterPrints(self.model)
                rec.wait_before_writes(self._settle_weights)
            else:
                self._prints.parameters = parameter_prints(self.model)
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            rec.diagnose(None, f"parameter fingerprints: {type(e).__name__}: {e}")

        def first_call(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._inputs is not None or rec.busy:
                return
            rec.busy = True  # the fingerprint's own ops are not the model's
            try:
                with torch._C._DisableTorchDispatch():  # accelerator inputs: read at the end (no sync in the forward)
                    self._inputs = launch_input_prints(args, kwargs)
            except Exception as e:  # noqa: BLE001
                rec.diagnose(None, f"input fingerprints: {type(e).__name__}: {e}")
            finally:
                rec.busy = False

        try:
            self._input_hook = self.model.register_forward_pre_hook(first_call, with_kwargs=True)
        except Exception as e:  # noqa: BLE001 - e.g. a scripted module: no input fingerprints, the capture goes on
            rec.diagnose(None, f"input fingerprints: {type(e).__name__}: {e}")

    def _read_inputs(self, rec: Recorder) -> None:
        """The model inputs' fingerprints, whose device reductions were queued at its first call."""
        pending, self._inputs = self._inputs, None
        if pending is None:
            return
        try:
            self._prints.inputs = pending.read()
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            rec.diagnose(None, f"input fingerprints: {type(e).__name__}: {e}")

    def _settle_weights(self) -> None:
        """Finish the parameter fingerprints (before anything may write into the weights)."""
        job, self._weights = self._weights, None
        if job is None:
            return
        try:
            self._prints.parameters = job.result()
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            job.notes.append(f"parameter fingerprints: {type(e).__name__}: {e}")
        assert self._recorder is not None
        for note in job.notes:
            self._recorder.diagnose(None, note)

    def _next_call(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """``call_steps``: a call of the model after its first starts the next step."""
        rec = self._recorder
        if rec is None or rec.busy:
            return
        if self._calls:
            rec.set_step(rec.step + 1)
        self._calls += 1

    def step(self) -> int:
        """Mark the end of one training/inference step; returns the number of the next step."""
        assert self._recorder is not None, "call step() inside the with block"
        self._recorder.set_step(self._recorder.step + 1)
        return self._recorder.step

    def abort(self) -> None:
        """Discard this capture: no bundle is written when the block exits."""
        self._aborted = True

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Torch work that is not the model's (an optimizer step, a copy) runs unrecorded in this block."""
        rec = self._recorder
        assert rec is not None, "call paused() inside the with block"
        busy, rec.busy = rec.busy, True
        try:
            with torch._C._DisableTorchDispatch():
                rec.settle_background()  # the block's writes are not seen by the dispatch mode
                yield
        finally:
            rec.busy = busy

    def record_tensor(self, module: str, op: str, tensor: torch.Tensor, kind: str = "grad") -> None:
        """Record a tensor the model's hooks do not see (e.g. a parameter update) as ``module/op#N``."""
        rec = self._recorder
        assert rec is not None, "call record_tensor() inside the with block"
        if not rec.active:
            return
        with self.paused():
            key, ordinal = rec.next_key(module, op)
            if rec.wants(module, op):
                rec.trusted = False  # the caller's names and kind: finish() validates every record
                rec.record(kind, module, op, key, ordinal, tensor, [tensor])
                rec.settle_background()  # on disk before the caller's unseen ops (a gradient clip) write into it

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` in the bundle under ``name`` (no record names it: e.g. a generation step's
        log-probabilities), whatever the capture mode; a name the bundle refuses raises ``ValueError``."""
        rec = self._recorder
        assert rec is not None, "call add_tensor() inside the with block"
        if not rec.active or rec.forked:
            return
        with self.paused():
            host = tensor.detach().to("cpu", torch.float32).contiguous()
            rec.add_tensor(name, host)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._graphs is not None:
            self._graphs.__exit__(None, None, None)
            self._graphs = None
        if self._mode is not None:
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
        if self._composites is not None:
            self._composites.__exit__(None, None, None)
            self._composites = None
        if self._hooks is not None:
            self._hooks.remove()
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        rec = self._recorder
        assert rec is not None
        if rec.forked:  # a child forked inside the block left it: the bundle is the parent's to write
            return
        if self._aborted or (exc_type is not None and not isinstance(exc, Exception)):
            rec.abort()  # KeyboardInterrupt / SystemExit: leave no bundle behind (a weight walk still
            return  # running ends on its own; nothing waits for it)
        try:
            self._settle_weights()
            self._read_inputs(rec)
            if exc_type is not None:
                rec.diagnose(None, f"the captured block raised {exc_type.__name__}: {exc}")
            opts = self.options
            run = {**opts.run, "level": opts.level, "mode": opts.mode, **({"engine": self.engine} if self.engine else {}),
                   "options": _options_note(opts), "intrusive_ops": intrusive_ops(opts.level)}
            if self.distributed is not None:
                run["distributed"] = self.distributed
            if opts.steps is not None or rec.step:
                run["steps"] = {"selected": opts.steps, "seen": rec.step + 1}
            prints = self._prints if (self._prints.inputs or self._prints.parameters) else None
            env = environment(opts.run.get("device"))
        except BaseException:
            rec.abort()  # e.g. Ctrl-C while the weight walk is awaited: no partial file, no writer thread
            raise
        self.bundle_path = rec.finish(run, env, prints)  # aborts by itself when it fails

    @property
    def records(self) -> Iterator[Record]:
        """The records so far (inside the block) or the bundle's (after it), in execution order."""
        return self._recorder.records if self._recorder else iter(())

    @property
    def diagnostics(self) -> list[Diagnostic]:
        """Problems the capture met without interrupting the run (the manifest's ``diagnostics``)."""
        return list(self._recorder.diagnostics) if self._recorder else []


def _options_note(opts: CaptureOptions) -> dict[str, Any]:
    d = asdict(opts)
    for k in ("run", "progress", "level", "mode", "fingerprints"):
        d.pop(k)
    if not d["call_steps"]:
        d.pop("call_steps")  # said only when on: a single forward's manifest is as before
    return d
