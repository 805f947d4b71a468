"""``with capture(model, path): model(...)``: record module outputs and ATen op outputs into a bundle.

Module level uses global forward hooks (``torch.nn.modules.module.register_module_forward_*``),
looking each module's path up in ``model.named_modules()``, so user code needs no changes. ATen
level adds a ``TorchDispatchMode`` that sees every op after autograd, tagged with the innermost
module path. Recording never raises into the user's forward pass: a failure becomes a diagnostic
in the manifest. Tensors are copied off the live run (the model may mutate them in place later),
buffered, and streamed to the bundle when the buffer fills.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from accuracy.bundle import BundleWriter
from accuracy.manifest import Diagnostic, Manifest, Record, Stats
from hooks import devices
from hooks.environment import environment
from hooks.tensors import NO_NUMBER_OPS, StatsBatch, stored_payload, tensor_dtype_name, unsupported_reason

LEVELS = ("module", "aten")
MODES = ("summary", "full")


@dataclass
class CaptureOptions:
    """What to record. Each field maps to one ``opband capture`` flag."""

    level: str = "aten"
    mode: str = "full"
    modules: list[str] | None = None  # module path globs to keep (None = all)
    ops: list[str] | None = None  # op name globs to keep (None = all)
    max_bytes: int | None = None  # past this many tensor bytes, keep summaries only
    buffer_bytes: int = 256 << 20  # host buffer before tensors are flushed to disk
    skip_no_number_ops: bool = True
    run: dict[str, Any] = field(default_factory=dict)
    progress: bool | None = None  # None: only when stderr is a TTY

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {self.level!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")


class _Recorder:
    """Shared state of one capture: records, pending tensors, ordinals, module stack."""

    def __init__(self, path: Path, opts: CaptureOptions) -> None:
        self.opts = opts
        self.writer = BundleWriter(path)
        self.records: list[Record] = []
        self.stats = StatsBatch()
        self.stats_of: list[int | None] = []
        self.pending: list[tuple[str, torch.Tensor, str]] = []
        self.pending_bytes = 0
        self.tensor_bytes = 0
        self.index = 0
        self.ordinals: Counter[tuple[str, str]] = Counter()
        self.stack: list[str] = []
        self.skipped: Counter[str] = Counter()
        self.diagnostics: list[Diagnostic] = []
        self.stored: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self.started = time.monotonic()
        self.last_progress = 0.0
        self.show_progress = sys.stderr.isatty() if opts.progress is None else opts.progress
        self.busy = False  # True while the recorder itself runs torch ops under the dispatch mode

    @property
    def module(self) -> str:
        return self.stack[-1] if self.stack else ""

    def wants(self, module: str, op: str) -> bool:
        if self.opts.modules and not any(fnmatch.fnmatchcase(module, g) for g in self.opts.modules):
            return False
        if self.opts.ops and not any(fnmatch.fnmatchcase(op, g) for g in self.opts.ops):
            return False
        return True

    def record_outputs(self, kind: str, module: str, op: str, inputs: Iterable[Any], outputs: Any) -> None:
        """Record every tensor in ``outputs`` under one op key. Never raises."""
        ordinal = self.ordinals[(module, op)]
        self.ordinals[(module, op)] += 1
        key = f"{module}/{op}#{ordinal}"
        try:
            if not self.wants(module, op):
                return
            in_tensors = [a for a in tree_flatten(list(inputs))[0] if isinstance(a, torch.Tensor)]
            shapes = [list(a.shape) for a in in_tensors]
            dtypes = [tensor_dtype_name(a) for a in in_tensors]
            flat, _ = tree_flatten(outputs)
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            for out_i, t in enumerate(tensors):
                self._record_one(kind, module, op, ordinal, key, out_i, t, shapes, dtypes)
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            self.diagnostics.append(Diagnostic(key=key, message=f"{type(e).__name__}: {e}"))

    def _record_one(self, kind: str, module: str, op: str, ordinal: int, key: str, out_i: int,
                    t: torch.Tensor, shapes: list[list[int]], dtypes: list[str]) -> None:
        reason = unsupported_reason(t)
        rec_id = key if out_i == 0 else f"{key}:{out_i}"
        if reason:
            self.diagnostics.append(Diagnostic(key=rec_id, message=f"skipped: {reason}"))
            return
        payload, tag, qparams = stored_payload(t)
        stats_slot = self.stats.add(payload, t)
        name = None
        if self.opts.mode == "full":
            name = self._store(rec_id, t, payload, tag)
        self.records.append(Record(
            key=key, output=out_i, module=module, op=op, ordinal=ordinal, kind=kind, index=self.index,
            input_shapes=shapes, input_dtypes=dtypes, shape=list(t.shape), dtype=tensor_dtype_name(t),
            tensor=name, qparams=qparams,
        ))
        self.stats_of.append(stats_slot)
        self.index += 1
        self._progress()

    def _store(self, rec_id: str, t: torch.Tensor, payload: torch.Tensor, tag: str) -> str | None:
        """Queue a host copy of ``payload``; reuse an identical tensor stored earlier."""
        prior = self.stored.get(id(t))
        if prior is not None and prior[0]() is t and prior[1] == t._version:
            return prior[2]
        nbytes = payload.numel() * payload.element_size()
        if self.opts.max_bytes is not None and self.tensor_bytes + nbytes > self.opts.max_bytes:
            return None  # past the byte budget: summary only
        host = devices.copy_to_host(payload)
        self.pending.append((rec_id, host, tag))
        self.pending_bytes += nbytes
        self.tensor_bytes += nbytes
        try:
            self.stored[id(t)] = (weakref.ref(t), t._version, rec_id)
        except TypeError:
            pass
        if self.pending_bytes >= self.opts.buffer_bytes:
            self.flush()
        return rec_id

    def flush(self) -> None:
        if not self.pending:
            return
        devices.synchronize_copies([h for _, h, _ in self.pending])
        for name, host, tag in self.pending:
            array = host.reshape(-1).numpy() if host.numel() else host.reshape(-1).numpy()
            self.writer.add(name, tag, tuple(host.shape), array.data)
        self.pending.clear()
        self.pending_bytes = 0

    def _progress(self, final: bool = False) -> None:
        if not self.show_progress:
            return
        now = time.monotonic()
        if final or now - self.last_progress > 0.5:
            self.last_progress = now
            mb = (self.writer.bytes_written + self.pending_bytes) / 1e6
            end = "\n" if final else "\r"
            print(f"opband capture: {self.index} records, {mb:,.1f} MB written, {now - self.started:.1f}s",
                  file=sys.stderr, end=end, flush=True)

    def finish(self, env: dict[str, Any]) -> Path:
        self.flush()
        summaries = self.stats.to_host()
        for rec, slot in zip(self.records, self.stats_of, strict=True):
            if slot is not None:
                rec.stats = Stats(**summaries[slot])
        manifest = Manifest(
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            run={**self.opts.run, "level": self.opts.level, "mode": self.opts.mode},
            environment=env,
            records=self.records,
            skipped_ops=dict(sorted(self.skipped.items())),
            diagnostics=self.diagnostics,
        )
        path = self.writer.close(manifest)
        self._progress(final=True)
        return path


class _AtenMode(TorchDispatchMode):
    """Records every ATen op that moves numbers, tagged with the innermost module path."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        rec = self.recorder
        if rec.busy:
            return out
        name = str(func.overloadpacket)
        if rec.opts.skip_no_number_ops and (name in NO_NUMBER_OPS or getattr(func, "is_view", False)):
            rec.skipped[name] += 1
            return out
        rec.record_outputs("aten", rec.module, name, (args, kwargs or {}), out)
        return out


class capture:  # noqa: N801 - used as a context manager, reads like a function
    """Record a model's operators while the block runs; the bundle is written when it exits.

    >>> with capture(model, "run.bundle", level="aten", mode="full"):
    ...     model(x)
    """

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike[str], **options: Any) -> None:
        self.model = model
        self.path = Path(path)
        self.options = CaptureOptions(**options)
        self.options.validate()
        self.bundle_path: Path | None = None
        self._handles: list[Any] = []
        self._mode: _AtenMode | None = None
        self._recorder: _Recorder | None = None

    def __enter__(self) -> capture:
        rec = self._recorder = _Recorder(self.path, self.options)
        names = {id(m): n for n, m in self.model.named_modules()}

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            name = names.get(id(module))
            if name is not None:
                rec.stack.append(name)

        def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            name = names.get(id(module))
            if name is None:
                return
            if rec.stack and rec.stack[-1] == name:
                rec.stack.pop()
            rec.busy = True
            try:
                rec.record_outputs("module", name, "forward", args, output)
            finally:
                rec.busy = False

        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
            torch.nn.modules.module.register_module_forward_hook(post_hook),
        ]
        if self.options.level == "aten":
            self._mode = _AtenMode(rec)
            self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []
        assert self._recorder is not None
        if exc_type is not None and not isinstance(exc, Exception):
            self._recorder.writer.abort()
            return
        if exc_type is not None:
            self._recorder.diagnostics.append(Diagnostic(message=f"the captured block raised {exc_type.__name__}: {exc}"))
        self.bundle_path = self._recorder.finish(environment(self.options.run.get("device")))

    @property
    def records(self) -> Iterator[Record]:
        return iter(self._recorder.records if self._recorder else [])
