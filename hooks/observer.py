"""The aten level's compiled path: summary and full captures on CPU without a Python call per op.

A ``TorchDispatchMode`` costs microseconds of Python per dispatched call before it does anything,
more than a small op itself. ``hooks._observer`` (``hooks/native/observer.cpp``, compiled when the package
is installed, see ``setup.py``) is a thread-local ``at::RecordFunction`` callback instead: it picks
the calls the dispatch mode would see (the outermost call that no ``CompositeImplicitAutograd``
kernel decomposes before the Python key), counts views and metadata ops as skipped, numbers each
call per module and op as the recorder does, and summarises each output with
:mod:`accuracy.fused`'s statistics kernel, called by address, so a record is the one
:class:`~hooks.modes.AtenMode` makes. Module attribution is compiled too (:meth:`ObserverMode.wrap_modules`):
each module's instance ``forward`` becomes a wrapper that does what the dispatch mode's global forward
hooks do (push the module's path on the recorder's stack, pop it, record the output tensors in order
with the ops), so ``nn.Module._call_impl`` keeps its fast path; an output that is not plain tensors goes
to the Python hook (:meth:`ObserverMode.record_module`), and a model the wrappers cannot serve keeps the
global hooks. Records leave the
observer as the JSON lines the bundle stores (byte for byte what pydantic writes). Any call with an
output the observer does not summarise itself (quantized, complex, a tensor subclass, a tensor on
another accelerator, a large tensor summarised by several threads) goes to the recorder in Python,
under the same key, after the observer's records so far were drained into the recorder's list.

A summary capture of a model on one CUDA device takes this path too when the module was built with
CUDA (``setup.py``: a CUDA torch and nvcc at install time; ``hooks._observer.CUDA``): each CUDA output's
row is launched from C++ on the op's current stream (``hooks/native/stats_cuda.cu``) into a row buffer
on the device, no host sync per op, and the rows come back in one copy at the end of the capture (a
drain inside the forward, for an op handed to Python, holds the records made so far until then). The dispatch mode computes CUDA rows with the same kernel
(:func:`hooks.tensors.device_stats`), so both engines write the same bits.

In full mode the observer also decides, by the recorder's rules (``Recorder._store``), which tensor
each record names: the same tensor at the same version, or a tensor stored from the same memory whose
statistics row the output reuses (a module output that is its last op's output, reshaped or not), is
stored once. It queues the others (the output itself when contiguous, else a contiguous copy) until
Python hands them to the bundle's writer thread, all queued ones in one call (buffers over their
memory, ``HeldBytes``: no tensor or array wrappers; ``Recorder.write_stored``): at each module's
forward hook, before any op that writes in place (after which the writer has finished reading what
it was given: the dispatch mode's rule), before ops the capture does not see, when 16 MB (or
`buffer_bytes`) are queued, and at the end.

:func:`why_not` says when a capture cannot take this path; it then uses the dispatch mode, as it
does for a byte budget in full mode, replay inputs, gradients, filters, other accelerators, full captures
of CUDA models and several ranks. Set
``OPBAND_OBSERVER=0`` to always use the dispatch mode.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from accuracy import fused
from accuracy.bundle.writer import RecordLines
from accuracy.capture_format import KERNEL_DTYPES, SAMPLE_SIZE, STAT_COUNTS, STAT_FIELDS
from accuracy.manifest import Record
from hooks import native_module
from hooks.options import CaptureOptions
from hooks.tensors import NO_NUMBER_OPS, dtype_tag, fast_leaves

if TYPE_CHECKING:
    from hooks.modes import ModuleHooks
    from hooks.recorder import Recorder

_observer: Any = native_module.compiled
_MISSING = native_module.MISSING

#: the observer capture running in this process (one at a time: its state is process-wide)
_ACTIVE: list[ObserverMode] = []

_DTYPE_NAMES: dict[int, str] = {}
_DTYPE_TAGS: dict[int, str] = {}

#: full mode: Python takes the queued tensors at once when this many bytes wait (or ``buffer_bytes``, if
#: less): outputs held for the writer stay bounded
HAND_BYTES = 16 << 20

#: tests: every drain inside the forward is deferred as CUDA rows make it, so the deferred path (held
#: records, reserved places, filled at the end) runs on CPU rows too
DEFER_ALL = False

#: the observer writes its record lines without validation: keys (module path, "/", op, "#", ordinal)
#: stay under Record.key's 4096 characters when module paths stay under this
_LONGEST_MODULE = 3584


def _dtype_names() -> dict[int, str]:
    """c10::ScalarType code -> dtype name (``float32``, ``int64`` …), as records name dtypes."""
    if not _DTYPE_NAMES and _observer is not None:
        with warnings.catch_warnings():  # quantized dtypes' deprecation notice
            warnings.simplefilter("ignore")
            for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
                try:
                    code = _observer.scalar_type_of(torch.empty(0, dtype=d))
                except (RuntimeError, TypeError):  # dtypes without tensors of their own (bits, sub-byte)
                    continue
                _DTYPE_NAMES[code] = str(d).removeprefix("torch.")
                tag = dtype_tag(d)
                if tag is not None:
                    _DTYPE_TAGS[code] = tag
    return _DTYPE_NAMES


def why_not(opts: CaptureOptions, model: torch.nn.Module) -> str | None:
    """Why this capture cannot use the compiled observer, or None when it can."""
    if os.environ.get("OPBAND_OBSERVER", "1") == "0":
        return "switched off by OPBAND_OBSERVER=0"
    unusable = native_module.unusable()
    if unusable:
        return unusable
    if opts.level != "aten":
        return "the observer serves the aten level"
    if opts.mode == "full" and opts.max_bytes is not None:
        return "a byte budget (max_bytes) takes the dispatch mode"
    if opts.inputs or opts.backward or opts.modules or opts.ops:
        return "replay inputs, gradients and module/op filters take the dispatch mode"
    if _ACTIVE:
        return "another observer capture is active in this process"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "collectives take the dispatch mode"
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None or \
            torch._C._len_torch_dispatch_stack() > 0:
        return "a Python dispatch mode is active"
    if any(len(name) > _LONGEST_MODULE for name, _ in model.named_modules()):
        return (f"a module path is longer than {_LONGEST_MODULE} characters: record keys (at most 4096) are "
                "validated on the dispatch mode's path")
    try:
        devices = {t.device for t in (*model.parameters(), *model.buffers())}
    except Exception:  # noqa: BLE001 - a model that cannot list its tensors keeps the dispatch mode
        return "the model's parameters could not be listed"
    accelerators = {d for d in devices if d.type != "cpu"}
    if not accelerators:
        return None
    if {d.type for d in accelerators} != {"cuda"} or len(accelerators) > 1:
        return "the observer summarises CPU and single-GPU CUDA tensors; this model's take the dispatch mode"
    if native_module.with_cuda() is None:
        return ("hooks._observer was built without CUDA (no CUDA torch or nvcc at install time): reinstall with "
                "`pip install --no-build-isolation` where both are, or CUDA models take the dispatch mode")
    if opts.mode == "full":
        return "full captures of CUDA models take the dispatch mode"
    if os.environ.get("OPBAND_DEVICE_STATS") in ("torch", "triton"):  # the observer has the compiled kernel only
        return f"OPBAND_DEVICE_STATS={os.environ['OPBAND_DEVICE_STATS']} asks for other CUDA statistics: the dispatch mode computes them"
    return None


def cuda_device(model: torch.nn.Module) -> int:
    """The index of the CUDA device holding ``model``'s tensors (one, :func:`why_not` checked), or -1."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_cuda:
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return -1


class ObserverMode:
    """While entered, the compiled observer records the model's ATen calls into ``recorder``."""

    def __init__(self, recorder: Recorder, module_names: list[str], cuda: int = -1) -> None:
        self.rec = recorder
        self.cuda = cuda  # the CUDA device whose outputs the observer summarises (-1: a CPU model)
        self.names = module_names
        self.index = {name: i for i, name in enumerate(module_names)}
        self.paused_depth = 0
        self.unwritten: set[str] = set()  # full mode: tensors stored here that could not be written
        self.full = recorder.opts.mode == "full"  # only full mode queues tensors for the writer
        self.wrapped: list[torch.nn.Module] = []  # modules whose forward is a compiled wrapper (wrap_modules)
        self.deferred: list[int] = []  # places in the record log of drains the observer held (drain)

    def __enter__(self) -> ObserverMode:
        assert _observer is not None
        rec = self.rec
        _dtype_names()  # before the observer starts: it makes a tensor of each dtype
        _observer.start({
            "per_step": rec.opts.call_steps, "stat_fields": list(STAT_FIELDS), "stat_counts": sorted(STAT_COUNTS), "sample_size": SAMPLE_SIZE,
            "skip_no_number_ops": rec.opts.skip_no_number_ops, "no_number_ops": sorted(NO_NUMBER_OPS),
            "row_functions": fused.row_cfunc_addresses(), "cancel": [fused.CANCEL[n] for n in KERNEL_DTYPES],
            "parallel_min": fused.PARALLEL_MIN, "module_names": self.names,
            "settle": self._settle, "escape": self._escape,
            "full": self.full, "hand_over": self._hand_over,
            "hand_bytes": min(HAND_BYTES, rec.opts.buffer_bytes), "cuda_device": self.cuda,
            "defer_all": DEFER_ALL,
        })
        _ACTIVE.append(self)
        rec.on_state = self.sync
        rec.stats.lookup = _observer.row_of  # a module output that aliases an op's output reuses its row
        rec.observed_name = self._stored_name  # … and names the tensor stored for it (full mode)
        self.sync()
        return self

    def wrap_modules(self, hooks: ModuleHooks) -> bool:
        """Module attribution without torch's hooked call path: each module's instance ``forward`` becomes
        a compiled wrapper doing what ``hooks``' global forward hooks do (its Python ``_post`` still
        records what the observer does not). False, with nothing changed, when a module could not be
        wrapped faithfully (its own ``__call__``, an instance ``forward`` already set, TorchScript, a
        compiled call): then ``hooks`` installs its global hooks."""
        assert _observer is not None
        modules = {id(m): m for _, m in hooks.model.named_modules()}
        if not all(_wrappable(m) for m in modules.values()):
            return False
        _observer.wrap_modules(self.rec.stack, self.index, hooks._post, torch.Tensor, self.index.get("", -1))
        for key, name in hooks.names.items():
            m = modules[key]
            m.__dict__["forward"] = _observer.module_call(m.forward, m, name, self.index[name])
            self.wrapped.append(m)
        return True

    def _unwrap_modules(self) -> None:
        """Each wrapped module's own ``forward`` again."""
        for m in self.wrapped:
            if type(m.__dict__.get("forward")) is _observer.ModuleCall:
                del m.__dict__["forward"]
        self.wrapped = []
        if _observer is not None:
            _observer.unwrap_modules()

    def __exit__(self, *exc: Any) -> None:
        rec = self.rec
        try:
            self._unwrap_modules()
            self.drain(final=True)
            counts = _observer.counts() if _observer is not None else {}
            for error in counts.get("errors", []):
                rec.diagnose(None, f"the CUDA statistics of an output could not be made: {error}")
            rec.skipped.update(counts.get("skipped", {}))
            rec.ops_seen += counts.get("ops_seen", 0)
        finally:
            rec.on_state = None
            rec.stats.lookup = None
            rec.observed_name = None
            _ACTIVE.remove(self)
            if _observer is not None:
                _observer.stop()

    def innermost(self) -> int:
        """The observer's index of the innermost module. Outside every module (a ``generate()`` loop's own
        ops) counts as the root's path ``""``, as the dispatch mode names it: one numbering for both,
        so the root module's own ops and the loop's never share a key."""
        stack = self.rec.stack
        return self.index.get(stack[-1] if stack else "", -1)

    def sync(self) -> None:
        """Tell the observer whether to record (active, not busy, not paused), the innermost module, the step."""
        rec = self.rec
        module = self.innermost()
        assert _observer is not None
        _observer.set_state(rec.active and not rec.busy and not self.paused_depth, module, rec.step, rec.active,
                            not self.paused_depth)

    def drain(self, final: bool = False) -> None:
        """Move the observer's records into the recorder's list (before the recorder adds one itself),
        and its queued tensors to the bundle writer. Inside the forward (not ``final``) while CUDA rows
        are pending, the observer holds the records and only their place is taken: reading the rows
        would wait for the device. The ``final`` drain fills those places, then adds the rest."""
        assert _observer is not None
        rec = self.rec
        self._hand_over()
        if final:
            for place, (data, count) in zip(self.deferred, _observer.held_lines(_dtype_names()), strict=True):
                rec.log.fill(place, self._lines(data, count))
            self.deferred = []
        data, count = _observer.drain_lines(len(rec.log), _dtype_names(), not final)  # JSON lines, as the bundle stores them
        if data is None:
            self.deferred.append(rec.log.reserve(count))
        elif count:
            rec.log.add_lines(self._lines(data, count))
        rec.stats.epoch = _observer.epoch()  # the writes it saw: earlier rows of the same memory are stale

    def _lines(self, data: bytes, count: int) -> RecordLines:
        """The observer's lines; no record names a tensor the bundle does not hold."""
        if not self.unwritten:
            return RecordLines(data, count)
        return RecordLines(b"".join(self._unnamed(line) + b"\n" for line in RecordLines(data, count).lines()), count)

    def record_module(self, name: str, args: Any, output: Any) -> bool:
        """A module's output (its forward hook, after the stack was popped): recorded by the observer,
        in order with the ops; False when the recorder must record it (any output that is not a
        plain tensor the observer summarises), after the observer's records were drained."""
        rec = self.rec
        inner = self.innermost()
        if not rec.active:
            self.sync()
            return True  # nothing to record
        recorded = False
        try:
            outs = [output] if type(output) is torch.Tensor else fast_leaves(output)
            recorded = all(type(t) is torch.Tensor for t in outs) and _observer is not None and \
                _observer.record_module(self.index[name], outs, fast_leaves(args), inner)
        except Exception:  # noqa: BLE001, S110 - the recorder's path says what is wrong with this output
            pass
        if recorded:
            if self.full:
                self._hand_over()  # its tensors go to the writer between modules
            return True
        self.drain()
        self.sync()
        return False

    def _escape(self, module: int, op: str, ordinal: int, out: Any, shapes: list[list[int] | None],
                dtypes: list[int], mutated: bool) -> None:
        """A call whose outputs the observer does not summarise: the recorder's own path, same key; its
        inputs as the observer read them at the call's start (shapes, c10::ScalarType codes)."""
        rec = self.rec
        self.drain()
        name = self.names[module] if module >= 0 else ""
        signature = (shapes, [_dtype_names()[code] for code in dtypes])
        # its torch ops are not the model's (no state sync: the observer is inside), nor a nested capture's
        with rec.own_ops(), torch._C._DisableTorchDispatch():
            rec.record("aten", name, op, rec.key(name, op, ordinal), ordinal, out, (), None, mutated, signature)

    def before_unseen_ops(self) -> None:
        """Ops the observer must not record are about to run (a compiled block): background readers
        of the model's memory finish first, as before an in-place op."""
        self._settle()

    def _settle(self) -> None:
        """Before an op writes in place (called by the observer) or unseen ops run: the queued tensors
        go to the writer, and background readers of the model's memory (the weight walk, the writer)
        finish."""
        self._hand_over()
        self.rec.settle_background()

    def _hand_over(self) -> None:
        """Full mode: the tensors the observer queued go to the bundle writer (``Recorder.write_stored``);
        one that fails is a diagnostic, and the records naming it keep their statistics only."""
        assert _observer is not None
        rec = self.rec
        taken = _observer.take_writes()
        if rec.forked or not taken:  # a forked child (a DataLoader worker): the parent writes its bundle, not this copy
            return
        tags = _DTYPE_TAGS
        items = [(name, tags[code], shape, data) for name, code, shape, data in taken]
        try:
            failed = rec.write_stored(items)
        except Exception as e:  # noqa: BLE001 - capture must never break the user's run
            failed = [(name, f"{type(e).__name__}: {e}") for name, *_ in items]
        for name, why in failed:
            if why:
                rec.diagnose(name, f"storing the tensor failed: {why}")
            self.unwritten.add(name)

    def _stored_name(self, t: torch.Tensor, share: bool) -> str | None:
        """For the recorder's Python path: the tensor the observer stored that ``t`` is (or aliases)."""
        assert _observer is not None
        name = _observer.stored_name(t, share)
        return None if name in self.unwritten else name

    def _unnamed(self, line: bytes) -> bytes:
        """A record line without its tensor when that tensor was not written."""
        record = Record.model_validate_json(line)
        if record.tensor not in self.unwritten:
            return line
        unnamed = record.model_copy(update={"tensor": None})
        return unnamed.__pydantic_serializer__.to_json(unnamed, exclude_none=True)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded in this block (``hooks.compiled`` runs compiled code here)."""
        self.paused_depth += 1
        self.sync()
        try:
            yield
        finally:
            self.paused_depth -= 1
            self.sync()


def _wrappable(m: torch.nn.Module) -> bool:
    """Whether a wrapper as the instance ``forward`` runs exactly where global forward hooks would: the
    call goes through ``nn.Module.__call__`` and ``_call_impl``, which look ``forward`` up on the instance."""
    cls = type(m)
    return ("forward" not in m.__dict__ and cls.__call__ is torch.nn.Module.__call__
            and cls._call_impl is torch.nn.Module._call_impl and getattr(m, "_compiled_call_impl", None) is None
            and not isinstance(m, torch.jit.ScriptModule))


def active() -> ObserverMode | None:
    """The observer capture running in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None

