"""The state of one capture: records, ordinals, the module stack, the tensor buffer and the writer.

Everything here is called from hooks inside the user's forward pass, so every public method
turns its own failures into diagnostics instead of raising.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import torch

from accuracy.bundle import BundleWriter
from accuracy.writebehind import WriteFailed
from accuracy import fused
from accuracy.capture_format import op_key
from accuracy.manifest import Diagnostic, Fingerprints, Manifest, Record
from hooks import devices
from hooks.opcall import layout_of
from hooks.options import CaptureOptions
from hooks.record_log import RecordLog, record_fields
from hooks.tensors import (
    DTYPE_NAMES,
    StatsBatch,
    StorageMap,
    fast_leaves,
    plain_payload,
    storage_key,
    stored_payload,
    tensor_dtype_name,
    unsupported_reason,
    version_of,
)


#: Tensor bytes a capture may have queued for its writer thread, not yet on disk (at most
#: ``CaptureOptions.buffer_bytes``): the outputs they belong to stay alive until written.
BACKGROUND_WRITE_BYTES = 16 << 20


def _shape(a: Any) -> list[int] | None:
    """The shape of a tensor input, or None (non-tensors, nested tensors have no single shape)."""
    if not isinstance(a, torch.Tensor):
        return None
    try:
        return list(a.shape)
    except RuntimeError:
        return None


def _signature(in_tensors: Sequence[Any]) -> tuple[list[list[int] | None], list[str | None]]:
    """The input shapes and dtype names of a call (None for what is not a tensor or has no shape)."""
    try:  # the common case, every input a plain tensor: one pass without a call per input
        return [list(a.shape) for a in in_tensors], [DTYPE_NAMES[a.dtype] for a in in_tensors]
    except (AttributeError, KeyError, RuntimeError, TypeError):
        return ([_shape(a) for a in in_tensors],
                [tensor_dtype_name(a) if isinstance(a, torch.Tensor) else None for a in in_tensors])


class Recorder:
    """Shared state of one capture run."""

    def __init__(self, path: Path, opts: CaptureOptions) -> None:
        self.opts = opts
        # the aten level's dispatch mode sees every in-place write, so it can drain the writer thread
        # before one: only there may tensors be written to disk after the op that made them returns
        self.writer = BundleWriter(path, background_bytes=min(opts.buffer_bytes, BACKGROUND_WRITE_BYTES)
                                   if opts.level == "aten" else 0)
        self.log = RecordLog()
        self.stats = StatsBatch(epochs=opts.level == "aten")
        self.pending: list[tuple[str, torch.Tensor, str]] = []  # host copies not yet handed to the writer
        # the aten level (every in-place write seen, so a copy still reading memory is fenced before
        # one): CUDA outputs are copied on a side stream, per device, and the writer thread waits for them
        self.side_copies: dict[torch.device, devices.SideCopies] | None = {} if opts.level == "aten" else None
        self._side_hosts: set[int] = set()  # ids of the pending host copies made on a side stream
        self.pending_bytes = 0
        self.tensor_bytes = 0
        self.ops_seen = 0
        self.ordinals: Counter[tuple[str, str]] = Counter()
        self.stack: list[str] = []
        self.skipped: Counter[str] = Counter()
        self.diagnostics: list[Diagnostic] = []
        self.calls: dict[str, dict[str, Any]] = {}
        self.stored: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        # Where each output's bytes live -> (write epoch, tensor name), to share one stored tensor
        # between an op's output and a reshaped alias of it (a bias-free Linear's module output is
        # ``_unsafe_view`` of its ``mm``). Needs the dispatch mode's epochs (every in-place write
        # seen); off with ``inputs``, whose names must keep each input's own shape for replay.
        self.by_storage = StorageMap()  # (*storage_key, tag) -> (epoch, tensor name, statistics slot)
        self._share_views = opts.level == "aten" and not opts.inputs
        # set by hooks.observer in full mode: the name of a tensor it stored that an output is (or aliases)
        self.observed_name: Callable[[torch.Tensor, bool], str | None] | None = None
        self._full = opts.mode == "full"
        self.step = 0
        # told when ``active`` or ``busy`` changes (hooks.observer keeps its compiled state in step)
        self.on_state: Callable[[], None] | None = None
        self._active = opts.steps is None or 0 in opts.steps
        self.closed = False
        self._busy = False  # True while the recorder itself runs torch ops under the dispatch mode
        # run by settle_background() when set: work that reads the model's memory in
        # the background (parameter fingerprints, tensor writes) finishes first
        self._settle: Callable[[], None] | None = None
        self._before_write: Callable[[], None] | None = self._quiesce if self.writer.background else None
        self._by_reference = False  # CPU memory handed to the writer thread since it last finished
        self.forked = False  # this is a fork of the capturing process (see _forked_off)
        self.write_error: str | None = None  # the writer thread's failure, once it failed
        _LIVE.add(self)
        self.started = time.monotonic()
        self.last_progress = self.started
        self.show_progress = sys.stderr.isatty() if opts.progress is None else opts.progress
        # every record comes from this module's own code, so finish() builds the models without
        # validating them again; a record of the user's (``capture.record_tensor``) clears this
        self.trusted = True
        self._module_globs = list(opts.modules or [])
        self._op_globs = list(opts.ops or [])
        fused.warm_up()  # compile (or load from numba's cache) the statistics kernels now, not in the first op

    @property
    def active(self) -> bool:
        """Recording in this step (``CaptureOptions.steps``) and not in a forked child."""
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        if self.on_state is not None:
            self.on_state()

    @property
    def busy(self) -> bool:
        """The recorder (or a paused block) runs torch ops that are not the model's."""
        return self._busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self._busy = value
        if self.on_state is not None:
            self.on_state()

    @contextmanager
    def own_ops(self) -> Iterator[None]:
        """The block runs torch ops of the capture's own (``busy``) without telling ``on_state``: for a
        caller that is inside the compiled observer's callback, which records nothing meanwhile."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    @property
    def records(self) -> Iterator[Record]:
        """Every record so far, in execution order."""
        return self.log.records()

    # -- background readers of the model's memory -------------------------------------------
    def wait_before_writes(self, settle: Callable[[], None]) -> None:
        """Have ``settle`` run, once, before the first op that writes in place (or :meth:`_quiesce`)."""
        self._settle = settle
        self._before_write = self._quiesce

    def settle_background(self) -> None:
        """Background readers of the model's memory finish now: before ops that write in place or
        that the capture does not see (a paused block, a compiled block) run."""
        if self._before_write is not None:
            self._before_write()

    def _quiesce(self) -> None:
        """Before an op writes in place, or ops the capture does not see run: background readers of
        the model's memory finish. Never raises (a failed write is reported again when the bundle closes)."""
        settle, self._settle = self._settle, None
        try:
            for copies in (self.side_copies or {}).values():
                copies.fence()
            if settle is not None:
                settle()
            if self._by_reference:  # the writer thread reads CPU memory the op may write: it finishes first
                self.writer.drain()
                self._by_reference = False
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            self._write_failed(e)
        if (not self.writer.background and not self.side_copies) or self.write_error is not None:
            self._before_write = None

    def _write_failed(self, e: BaseException) -> None:
        """The writer thread failed (disk full …): said once; later tensors are kept as summaries only,
        and closing the bundle raises the error."""
        if self.write_error is None:
            self.write_error = f"{type(e).__name__}: {e}"
            self.diagnose(None, f"writing tensors failed ({self.write_error}); later tensors were not stored")

    # -- keys and filters -------------------------------------------------------------------
    @property
    def module(self) -> str:
        return self.stack[-1] if self.stack else ""

    def next_key(self, module: str, op: str) -> tuple[str, int]:
        """``module/op#ordinal``; ordinals count every call, filtered or not, so keys are stable."""
        k = (module, op)
        ordinal = self.ordinals[k]
        self.ordinals[k] = ordinal + 1
        return self.key(module, op, ordinal), ordinal

    def key(self, module: str, op: str, ordinal: int) -> str:
        """The op key of call ``ordinal`` of ``op`` in ``module`` in the current step (:func:`op_key`)."""
        return op_key(module, op, ordinal, self.step if self.opts.call_steps else 0)

    @property
    def filtered(self) -> bool:
        """Module or op globs select what is recorded (:meth:`wants` decides)."""
        return bool(self._module_globs or self._op_globs)

    def wants(self, module: str, op: str) -> bool:
        if self._module_globs and not any(fnmatch.fnmatchcase(module, g) for g in self._module_globs):
            return False
        if self._op_globs and not any(fnmatch.fnmatchcase(op, g) for g in self._op_globs):
            return False
        return True

    def set_step(self, step: int) -> None:
        if self.opts.call_steps and step != self.step:
            self.ordinals.clear()  # each step numbers its calls afresh
        self.step = step
        self.active = self.opts.steps is None or step in self.opts.steps

    def diagnose(self, key: str | None, e: BaseException | str) -> None:
        msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        self.diagnostics.append(Diagnostic(key=key, message=msg))

    # -- recording --------------------------------------------------------------------------
    def snapshot_inputs(self, key: str, tensors: Sequence[torch.Tensor]) -> list[str | None]:
        """Store each input tensor now (before an in-place op can change it); names or None."""
        names: list[str | None] = []
        for i, t in enumerate(tensors):
            name = None
            try:
                if unsupported_reason(t) is None:
                    name = self._store(f"{key}.in{i}", t, stored_payload(t))
            except Exception as e:  # noqa: BLE001 - capture must never break the user's run
                self.diagnose(key, e)
            names.append(name)
        return names

    def record(self, kind: str, module: str, op: str, key: str, ordinal: int, outputs: Any,
               in_tensors: Sequence[Any] = (), input_names: list[str | None] | None = None,
               mutated: bool = False, signature: tuple[list[list[int] | None], list[str | None]] | None = None) -> None:
        """Record every tensor in ``outputs`` under ``key``. Never raises.

        ``mutated``: the op wrote into its outputs in place (``add_``, ``out=``). Inside a dispatch
        mode the version counter is bumped only after the op returns, so such outputs must not be
        matched against copies or statistics taken earlier. ``signature``: the inputs' shapes and dtype
        names, when the caller read them instead of passing ``in_tensors``.
        """
        try:
            shapes, dtypes = _signature(in_tensors) if signature is None else signature
            tensors = [outputs] if type(outputs) is torch.Tensor else fast_leaves(outputs)
        except Exception as e:  # noqa: BLE001
            self.diagnose(key, e)
            return
        for out_i, t in enumerate(tensors):
            try:
                self._record_one(kind, module, op, ordinal, key, out_i, t, shapes, dtypes, input_names, mutated)
            except Exception as e:  # noqa: BLE001 - one odd output must not lose the others
                self.diagnose(key if out_i == 0 else f"{key}:{out_i}", e)
        if self.show_progress:
            self._progress()

    def record_summary(self, kind: str, module: str, op: str, key: str, ordinal: int, output: int,
                       shapes: list[Any], dtypes: list[Any], shape: list[int], dtype: str,
                       stats: dict[str, Any] | None) -> None:
        """A record of statistics another tool computed (an imported dump): validated when the bundle is written."""
        self.trusted = False
        self.log.add(record_fields(key, output, module, op, ordinal, kind, len(self.log), shapes, dtypes, shape, dtype,
                                   None, None, stats, None, self.step, None, None), None)

    def _record_one(self, kind: str, module: str, op: str, ordinal: int, key: str, out_i: int, t: torch.Tensor,
                    shapes: list[Any], dtypes: list[Any], input_names: list[str | None] | None,
                    mutated: bool = False) -> None:
        rec_id = key if out_i == 0 else f"{key}:{out_i}"
        payload = plain_payload(t)
        if payload is None:
            reason = unsupported_reason(t)
            if reason:
                self.diagnose(rec_id, f"skipped: {reason}")
                return
            payload = stored_payload(t)
        slot = self.stats.add(payload.values, None if mutated else t)
        name = (self._store(rec_id, t, payload, reuse=not mutated, share=self._share_views and not mutated, slot=slot)
                if self._full else None)
        strides, memory_format = (None, None) if t.is_contiguous() else layout_of(t)
        self.log.add(record_fields(  # validated once, in finish()
            key, out_i, module, op, ordinal, kind, len(self.log), shapes, dtypes, payload.shape, payload.dtype, name,
            input_names, None, payload.extra, self.step, strides, memory_format), slot)

    def _store(self, rec_id: str, t: torch.Tensor, payload: Any, reuse: bool = True, share: bool = False,
               slot: int | None = None) -> str | None:
        """Queue a host copy of the payload; reuse an identical tensor stored earlier.

        ``reuse``: the same tensor object at the same version was stored already. ``share``: also
        reuse a tensor stored from the same memory (same storage, offset, element count, dtype and
        tag, both contiguous, no in-place write since, and its statistics row ``slot`` reused after
        :meth:`StatsBatch._unchanged` re-read sampled elements), which may have another shape
        (bundle format 1.1). CPU only: on an accelerator that re-read would sync the device.
        """
        version = version_of(t)
        prior = self.stored.get(id(t)) if reuse and version is not None else None
        if prior is not None and prior[0]() is t and prior[1] == version:
            return prior[2]
        if reuse and self.observed_name is not None:  # stored by the compiled observer (hooks.observer)?
            name = self.observed_name(t, share and slot is not None)
            if name is not None:
                return name
        data = payload.tensor
        key = storage_key(data) if share and data.device.type == "cpu" else None
        where = (*key, payload.tag) if key is not None else None
        if where is not None:
            hit = self.by_storage.get(where)
            if hit is not None and hit[0] == self.stats.epoch and hit[2] == slot and slot is not None:
                return hit[1]
        nbytes = data.numel() * data.element_size()
        if self.write_error is not None:
            self.skipped["(tensor writes failed)"] += 1
            return None
        if self.opts.max_bytes is not None and self.tensor_bytes + nbytes > self.opts.max_bytes:
            self.skipped["(over byte budget)"] += 1
            return None
        self.tensor_bytes += nbytes
        if self.write_through(data):  # the file write is the copy: no clone, no buffer
            host = data.contiguous()
            if not self._write_host(rec_id, payload.tag, tuple(host.shape), host.reshape(-1)):
                return None
        else:
            self.pending.append((rec_id, self._host_copy(data), payload.tag))
            self.pending_bytes += nbytes
        if version is not None and reuse:  # a written-to output's version is bumped after the op (or never)
            self.stored[id(t)] = (weakref.ref(t), version, rec_id)
        if where is not None:
            self.by_storage.put(where, (self.stats.epoch, rec_id, slot), data)
        if self.pending_bytes and self.pending_bytes + self.writer.unwritten_bytes >= self.opts.buffer_bytes:
            self.flush()  # host copies and what the writer thread still holds share the buffer
        return rec_id

    def write_stored(self, taken: Sequence[tuple[str, str, tuple[int, ...], Any]]) -> list[tuple[str, str]]:
        """Tensors the compiled observer (hooks.observer, full mode) stored, as ``(name, dtype tag, shape,
        flat bytes)``, handed to the bundle writer in one call (the writer thread reads the buffers later:
        their memory stays unchanged until :meth:`settle_background`); returns ``(name, why)`` for each one
        not written (``why`` is empty after the writer thread failed: nothing more is written, and closing
        the bundle raises)."""
        if self.write_error is not None:
            return [(name, "") for name, *_ in taken]
        before = self.writer.bytes_written
        try:
            refused = self.writer.add_views(taken)
            self._by_reference = self.writer.background
        except WriteFailed as e:  # the thread's earlier failure, not these tensors'
            self._write_failed(e)
            return [(name, "") for name, *_ in taken]
        self.tensor_bytes += self.writer.bytes_written - before
        return refused

    def add_tensor(self, name: str, host: torch.Tensor) -> None:
        """Store a contiguous float32 CPU tensor that no record names (``capture.add_tensor``), in any mode."""
        if self.write_error is not None:
            return
        self.settle_background()
        if self._write_host(name, "F32", tuple(host.shape), host.reshape(-1)):
            self.tensor_bytes += host.numel() * 4
            self.writer.drain()  # the caller's buffer may be freed as soon as this returns

    def _write_host(self, name: str, tag: str, shape: tuple[int, ...], flat: torch.Tensor) -> bool:
        """Hand a flat contiguous CPU tensor to the writer (its memory is read later: see
        :meth:`settle_background`); False when the writer thread failed earlier."""
        try:
            self.writer.add(name, tag, shape, flat.numpy().data)
            self._by_reference = self.writer.background
        except WriteFailed as e:  # the thread's earlier failure, not this tensor's
            self._write_failed(e)
            return False
        return True

    @staticmethod
    def write_through(data: torch.Tensor) -> bool:
        """CPU tensors are written at once; accelerator tensors go through the pinned buffer."""
        return data.device.type == "cpu"

    def _host_copy(self, data: torch.Tensor) -> torch.Tensor:
        """A host copy of an accelerator tensor: on the device's side stream for CUDA at the aten level
        (:class:`~hooks.devices.SideCopies`), else non-blocking into pinned memory on the current stream."""
        if self.side_copies is None or not devices.SideCopies.serves(data):
            return devices.copy_to_host(data)
        copies = self.side_copies.get(data.device)
        if copies is None:
            copies = self.side_copies[data.device] = devices.SideCopies(data.device)
            self._before_write = self._quiesce  # in-place writes fence the copies (and drain the writer)
        host = copies.copy(data)
        self._side_hosts.add(id(host))
        return host

    def flush(self) -> None:
        """Hand the host copies to the writer: side-stream copies with a callable the writer thread waits
        on (the model's thread never waits for them), others after a wait for their copies."""
        if not self.pending:
            return
        side = [p for p in self.pending if id(p[1]) in self._side_hosts]
        others = [p for p in self.pending if id(p[1]) not in self._side_hosts]
        devices.synchronize_copies([h for _, h, _ in others])
        try:
            for name, host, tag in others:
                self.writer.add(name, tag, tuple(host.shape), host.reshape(-1).numpy().data)
            if side:
                waits = [c.ready() for c in self.side_copies.values()]  # type: ignore[union-attr]
                refused = self.writer.add_views([(name, tag, tuple(host.shape), host.reshape(-1).numpy().data)
                                                 for name, host, tag in side],
                                                ready=waits[0] if len(waits) == 1 else lambda: [w() for w in waits])
                for name, why in refused:
                    self.diagnose(name, f"tensor not written: {why}")
        except WriteFailed as e:
            self._write_failed(e)
        finally:
            self.pending.clear()
            self._side_hosts.clear()
            self.pending_bytes = 0

    # -- progress and finish ----------------------------------------------------------------
    def _progress(self, final: bool = False) -> None:
        if not self.show_progress:
            return
        now = time.monotonic()
        if final or now - self.last_progress > 0.5:
            self.last_progress = now
            mb = (self.writer.bytes_written + self.pending_bytes) / 1e6
            print(f"opband capture: {self.ops_seen:,} ops seen, {len(self.log):,} records, "
                  f"{mb:,.1f} MB written, {now - self.started:.1f}s",
                  file=sys.stderr, end="\n" if final else "\r", flush=True)

    def finish(self, run: dict[str, Any], env: dict[str, Any], fingerprints: Fingerprints | None = None) -> Path:
        """Write the bundle; on any failure nothing is left behind (no partial file, no writer thread)."""
        try:
            return self._finish(run, env, fingerprints)
        except BaseException:
            self.abort()
            raise

    def _finish(self, run: dict[str, Any], env: dict[str, Any], fingerprints: Fingerprints | None) -> Path:
        self.closed = True
        self.flush()
        self.log.fill_stats(self.stats.to_host())
        if self.calls:
            run = {**run, "calls": self.calls}
        if self.side_copies:  # CUDA outputs copied on side streams: the one wait the capturing thread may have had
            run = {**run, "side_copies": {"devices": [str(d) for d in self.side_copies],
                                          "waited_for_the_writer_s": round(self.writer.waited_s, 6)}}
        fields = {"created_at": datetime.now(UTC).isoformat(timespec="seconds"), "run": run, "environment": env,
                  "skipped_ops": dict(sorted(self.skipped.items())), "diagnostics": self.diagnostics,
                  "fingerprints": fingerprints}
        try:  # records this package built are models already; anything else is validated (pydantic-core)
            manifest = Manifest.model_validate({**fields, "records": self.log.fields(self.trusted)})
        except pydantic.ValidationError as e:  # keep the capture: store what was recorded, say what is odd
            self.diagnose(None, f"manifest validation: {str(e)[:2000]}")
            manifest = Manifest(**{**fields, "diagnostics": self.diagnostics}, records=self.log.unchecked())
        records = self.log.settle(manifest.records)
        if self.log.has_lines:  # the observer's lines and the others' models, in order, all written as lines
            self.writer.add_records(records)
            manifest.records = []
        path = self.writer.close(manifest)
        self._progress(final=True)
        return path

    def abort(self) -> None:
        self.closed = True
        self.writer.abort()

    def _forked_off(self) -> None:
        """In a child forked during the capture (a DataLoader worker): record nothing, wait for no
        thread (the parent's threads do not exist here) and never touch the parent's bundle."""
        self.forked = True
        self.active = False
        self.closed = True
        self._before_write = None
        self._settle = None
        self.writer.forget()


#: recorders of captures in progress in this process (a forked child silences its copies)
_LIVE: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _silence_in_child() -> None:
    for rec in list(_LIVE):
        try:
            rec._forked_off()
        except Exception:  # noqa: BLE001, S110 - the next recorder is silenced all the same
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_silence_in_child)
