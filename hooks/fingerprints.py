"""Fingerprints of a run's model inputs and of each parameter and buffer, for the manifest.

``accuracy.fingerprints`` compares them: different inputs make two runs incomparable, different
parameters are a finding that names the module. A fingerprint is a digest of the tensor's bytes
(CPU tensors; on an accelerator the weights are not copied to the host) plus float64 sum, L2 norm
and absmax, which still compare across an honest dtype cast.
"""

from __future__ import annotations

import ctypes
import math
import threading
from functools import cache
from typing import Any, NamedTuple

import numpy as np

import torch
import xxhash
from torch.utils._pytree import tree_flatten_with_path, keystr

from accuracy import fused
from accuracy.manifest import TensorPrint
from hooks.tensors import KERNEL_DTYPES, tensor_dtype_name, version_of


def tensor_print(t: torch.Tensor) -> TensorPrint | None:
    """The fingerprint of one dense tensor (None for quantized, sparse, nested or meta tensors)."""
    with torch.no_grad():
        return _print(t)


def _print(t: torch.Tensor) -> TensorPrint | None:
    """:func:`tensor_print`, under ``no_grad`` already."""
    if not _printable(t):
        return None
    if (src := _kernel_input(t)) is not None:
        return _print_from(t, _walk_all([src], CHUNK_BYTES)[0])
    data = t.detach().resolve_conj().resolve_neg()
    if not data.is_cpu:
        return _device_prints([t])[0]
    data = data.contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else b""
    digest = xxhash.xxh3_128_hexdigest(raw)  # xxh3 runs near memory speed; a cryptographic digest would cost a forward pass
    return _statistics_print(t, _as_real_float(data), digest)


def _printable(t: torch.Tensor) -> bool:
    return not (t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested)


def _as_real_float(data: torch.Tensor) -> torch.Tensor:
    if data.is_complex():
        data = torch.view_as_real(data)
    return data if data.is_floating_point() else data.to(torch.float64)


def _statistics_print(t: torch.Tensor, data: torch.Tensor, digest: str) -> TensorPrint:
    """The print from torch's float64 reductions over the finite values (a host sync each on an accelerator)."""
    total = float(torch.sum(data, dtype=torch.float64)) if data.numel() else 0.0
    nonfinite = 0
    if not math.isfinite(total):
        finite = torch.isfinite(data)
        nonfinite = int(data.numel() - int(finite.sum()))
        data = data[finite]
        total = float(torch.sum(data, dtype=torch.float64)) if data.numel() else 0.0
    empty = data.numel() == 0
    return TensorPrint(shape=list(t.shape), dtype=tensor_dtype_name(t), digest=digest, sum=total,
                       l2=0.0 if empty else float(torch.linalg.vector_norm(data, dtype=torch.float64)),
                       absmax=0.0 if empty else float(data.abs().max()), nonfinite=nonfinite)


def _device_prints(tensors: list[torch.Tensor], masked: bool = False) -> list[TensorPrint | None]:
    """Prints of accelerator tensors without a host copy of their bytes (no digest) and with one host
    sync per device for all of them: each tensor's float64 sum, L2 and absmax are reductions left on
    the device, stacked and read at once (one ``.tolist()``; a sync per weight per statistic would cost
    as much as the forward pass). A tensor holding NaN/Inf (its L2
    is not finite) is redone over its finite values (:func:`_statistics_print`), unless ``masked``
    (:class:`DevicePrints`). Works on CPU tensors too (tests compare it with the CPU kernel's prints).
    None for a tensor torch cannot read."""
    return DevicePrints(tensors, masked).read()


class DevicePrints:
    """:func:`_device_prints` in two steps: the reductions are queued on the device now, :meth:`read`
    fetches them later (the one host sync). ``masked``: over the finite values from the start, with
    the NaN/Inf count (two more reductions a tensor), so that :meth:`read` needs nothing of the
    tensors: the model's inputs are fingerprinted so inside the captured forward pass, which must
    not sync the device, and read when the capture ends."""

    def __init__(self, tensors: list[torch.Tensor], masked: bool = False) -> None:
        self._tensors: list[torch.Tensor] | None = None if masked else tensors  # masked: nothing kept alive
        self._meta = [(list(t.shape), tensor_dtype_name(t)) for t in tensors]
        self._masked = masked
        self._out: list[TensorPrint | None] = [None] * len(tensors)
        self._pending: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        with torch.no_grad():
            for i, t in enumerate(tensors):
                try:
                    if not _printable(t):
                        continue
                    data = _as_real_float(t.detach().resolve_conj().resolve_neg())
                    if data.numel() == 0:
                        self._out[i] = _statistics_print(t, data, "")
                        continue
                    row = self._reductions(data)
                except (RuntimeError, TypeError):  # a tensor subclass that cannot be read: not fingerprinted
                    continue
                idx, rows = self._pending.setdefault(data.device, ([], []))
                idx.append(i)
                rows.extend(row)

    def _reductions(self, data: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._masked:
            finite = torch.isfinite(data)
            data = torch.where(finite, data, 0)
        row = (torch.sum(data, dtype=torch.float64), torch.linalg.vector_norm(data, dtype=torch.float64),
               data.abs().amax().to(torch.float64))
        return (*row, finite.logical_not().sum().to(torch.float64)) if self._masked else row

    def read(self) -> list[TensorPrint | None]:
        """The prints, in the tensors' order (one host read per device; a tensor whose reductions cannot
        be read, or redone, is None and the others keep theirs)."""
        width = 4 if self._masked else 3
        with torch.no_grad():
            for idx, rows in self._pending.values():
                try:
                    values = torch.stack(rows).tolist()
                except (RuntimeError, TypeError):  # one unreadable tensor (a subclass): read them one by one
                    values = [v for k in range(len(idx)) for v in self._read_one(rows[width * k:width * k + width])]
                assert len(values) == width * len(idx)
                for k, i in enumerate(idx):
                    total, l2, absmax, *nonfinite = values[width * k:width * k + width]
                    self._out[i] = self._print(i, total, l2, absmax, nonfinite)
            self._pending = {}
        return self._out

    @staticmethod
    def _read_one(row: list[torch.Tensor]) -> list[float | None]:
        try:
            return torch.stack(row).tolist()
        except (RuntimeError, TypeError):
            return [None] * len(row)

    def _print(self, i: int, total: float | None, l2: float | None, absmax: float | None,
               nonfinite: list[float | None]) -> TensorPrint | None:
        shape, dtype = self._meta[i]
        if total is None or l2 is None or absmax is None:  # could not be read (see read)
            return None
        if self._masked or math.isfinite(l2):
            return TensorPrint(shape=shape, dtype=dtype, digest="", sum=total, l2=l2, absmax=absmax,
                               nonfinite=int(nonfinite[0] or 0) if nonfinite else 0)
        assert self._tensors is not None
        t = self._tensors[i]
        try:
            return _statistics_print(t, _as_real_float(t.detach().resolve_conj().resolve_neg()), "")
        except (RuntimeError, TypeError):
            return None


#: Bytes hashed and then summarised at a time: the statistics read them back from the core's cache,
#: so a weight costs one trip over memory, not two.
#: A whole number of the statistics kernel's blocks for every element size.
CHUNK_BYTES = 256 << 10
assert CHUNK_BYTES % (fused.STATS_BLOCK * 8) == 0


class _KernelInput(NamedTuple):
    """What a walk reads: a contiguous tensor's bytes by address, their size, element size and the
    kernel's dtype name (``owner``, the tensor or array, is held so that its memory stays while the
    walk reads it)."""

    owner: object
    addr: int
    nbytes: int
    item: int
    dtype: str

    @classmethod
    def of(cls, data: torch.Tensor) -> _KernelInput:
        item = data.element_size()
        return cls(data, data.data_ptr(), data.numel() * item, item, KERNEL_DTYPES[data.dtype])

    def raw(self) -> memoryview:
        """The bytes as a flat buffer (no torch op: a thread may call it)."""
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.addr)).cast("B")


class _Digest(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]  # XXH128_hash_t


class _Xxh3(NamedTuple):
    """xxh3-128's streaming C functions as the ``xxhash`` package's own extension exports them: the
    walk updates their states from compiled code (``accuracy.fused.hashed_heads``), so many tensors are
    hashed and summarised in one call, without Python or the GIL between chunks."""

    update: int  # address of int XXH3_128bits_update(state*, const void*, size_t), the CPU-dispatched one
    create: Any
    reset: Any
    digest: Any

    def hexdigest(self, state: int) -> str:
        """The state's digest as ``xxhash.xxh3_128.hexdigest`` spells it (canonical: high half first)."""
        d = self.digest(state)
        return f"{d.high64:016x}{d.low64:016x}"


@cache
def _xxh3() -> _Xxh3 | None:
    """The package's C functions, checked against ``xxhash.xxh3_128_hexdigest`` on a few sizes; None
    where its extension does not export them (another build), and walks go chunk by chunk in Python."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
        create, reset, digest = lib.XXH3_createState, lib.XXH3_128bits_reset, lib.XXH3_128bits_digest
    except (AttributeError, OSError):
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    digest.restype, digest.argtypes = _Digest, [ctypes.c_void_p]
    found = _Xxh3(ctypes.cast(update, ctypes.c_void_p).value, create, reset, digest)  # a resolved symbol: not NULL
    probe = np.arange(CHUNK_BYTES // 4 + 4099, dtype=np.float32)  # a whole chunk and a partial one; no torch
    srcs = [_KernelInput(probe, probe.ctypes.data, 4 * n, 4, "float32") for n in (1, 4099, probe.size)]  # op: any thread
    try:
        digests = [d for d, _ in _native_walk(found, srcs)]
    except Exception:  # noqa: BLE001 - unusable here: the Python walk
        return None
    expected = [xxhash.xxh3_128_hexdigest(s.raw()) for s in srcs]
    return found if digests == expected else None


#: tensors a native walk takes at a time (each needs one xxh3 state, ~600 bytes, kept for reuse)
NATIVE_BATCH = 256
_STATES: list[int] = []
_STATES_LOCK = threading.Lock()


def _native_walk(xxh3: _Xxh3, srcs: list[_KernelInput]) -> list[tuple[str, np.ndarray]]:
    """``(digest, statistics head)`` of each input, NATIVE_BATCH at a time, :data:`CHUNK_BYTES` per
    chunk inside one compiled call (no GIL held)."""
    out: list[tuple[str, np.ndarray]] = []
    for b in range(0, len(srcs), NATIVE_BATCH):
        batch = srcs[b:b + NATIVE_BATCH]
        with _STATES_LOCK:
            states = [_STATES.pop() if _STATES else xxh3.create() for _ in batch]
        try:
            if not all(states):
                raise MemoryError("XXH3_createState returned NULL")
            for state in states:
                xxh3.reset(state)
            heads = fused.hashed_heads(
                xxh3.update, np.array(states, np.int64), np.array([s.addr for s in batch], np.int64),
                np.array([s.nbytes for s in batch], np.int64),
                np.array([fused.KIND_CODES[s.dtype] for s in batch], np.int64), CHUNK_BYTES)
            out.extend((xxh3.hexdigest(state), heads[i]) for i, state in enumerate(states))
        finally:
            with _STATES_LOCK:
                _STATES.extend(s for s in states if s)
    return out


def _walk_all(srcs: list[_KernelInput], python_chunk: int) -> list[tuple[str, np.ndarray]]:
    """``(digest, statistics head)`` of each input: in compiled code where xxhash's C functions are
    available (:func:`_xxh3`), else chunk by chunk in Python, ``python_chunk`` bytes at a time. No
    torch op (a thread may run it)."""
    xxh3 = _xxh3()
    if xxh3 is None:
        return [_walk(src, python_chunk) for src in srcs]
    return _native_walk(xxh3, srcs)


def _walk(src: _KernelInput, chunk: int) -> tuple[str, np.ndarray]:
    """``(digest, statistics head)`` of ``src``, chunk by chunk from Python (where :func:`_xxh3` is None)."""
    more = fused.MORE_AT[src.dtype]
    head = fused.empty_head()
    hasher = xxhash.xxh3_128()
    raw, addr, item, nbytes = src.raw(), src.addr, src.item, src.nbytes
    for start in range(0, nbytes, chunk):
        stop = min(start + chunk, nbytes)
        hasher.update(raw[start:stop])  # both release the GIL
        more(addr + start, (stop - start) // item, head)
    return hasher.hexdigest(), head


def _print_from(t: torch.Tensor, walked: tuple[str, np.ndarray]) -> TensorPrint:
    digest, head = walked
    lo, hi, total, squares = float(head[0]), float(head[1]), float(head[2]), float(head[3])
    nonfinite, count = int(head[4] + head[5]), int(head[7])
    mean = total / max(count, 1)  # sum as mean x count: the value earlier opbands stored
    return TensorPrint(shape=list(t.shape), dtype=tensor_dtype_name(t), digest=digest, sum=mean * count,
                       l2=math.sqrt(squares), absmax=max(-lo, hi) if count else 0.0, nonfinite=nonfinite)


def input_prints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, TensorPrint]:
    """Fingerprints of every tensor among a call's arguments, named ``arg0``, ``input_ids``, ``x[1]`` …"""
    return launch_input_prints(args, kwargs).read()


def launch_input_prints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> PendingPrints:
    """:func:`input_prints` without a device sync now: accelerator inputs' reductions are queued
    (:class:`DevicePrints`, masked) and :meth:`PendingPrints.read` fetches them."""
    leaves, _ = tree_flatten_with_path((args, kwargs))
    with torch.no_grad():
        return _prints_of([(_name(path), leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)], masked=True)


def _name(path: tuple[Any, ...]) -> str:
    """``((SequenceKey(0), SequenceKey(1)) -> arg1``, ``(SequenceKey(1), MappingKey('input_ids')) -> input_ids``."""
    head, rest = path[0], path[1:]
    if not rest:
        return "args"
    first, tail = rest[0], rest[1:]
    name = f"arg{first.idx}" if head.idx == 0 else str(getattr(first, "key", first))
    return name + (keystr(tail) if tail else "")


def parameter_prints(model: torch.nn.Module) -> dict[str, TensorPrint]:
    """Fingerprints of the model's parameters and buffers, by their dotted names."""
    with torch.no_grad():
        return _prints_of(_parameters_and_buffers(model)).read()


class PendingPrints:
    """Prints by name whose accelerator part is still on the device until :meth:`read`."""

    def __init__(self, prints: dict[str, TensorPrint | None], names: list[str], on_device: DevicePrints) -> None:
        self._prints, self._names, self._on_device = prints, names, on_device

    def read(self) -> dict[str, TensorPrint]:
        """Every fingerprint by name, in the order given (the tensors that could not be read left out)."""
        for name, fp in zip(self._names, self._on_device.read()):
            self._prints[name] = fp
        return {name: fp for name, fp in self._prints.items() if fp is not None}


def _prints_of(named: list[tuple[str, torch.Tensor]], masked: bool = False) -> PendingPrints:
    """Prints by name, in ``named``'s order: CPU tensors now (those of the statistics kernel's dtypes
    in one walk, :func:`_walk_all`), accelerator ones batched (:class:`DevicePrints`) and read by
    :meth:`PendingPrints.read`."""
    out: dict[str, TensorPrint | None] = {}
    on_device: list[tuple[str, torch.Tensor]] = []
    walks: list[tuple[str, torch.Tensor, _KernelInput]] = []
    for name, t in named:
        out[name] = None
        if _on_accelerator(t):
            on_device.append((name, t))
        elif (src := _kernel_input(t)) is not None:
            walks.append((name, t, src))
        else:
            out[name] = _guarded_print(t)
    for (name, t, _), walked in zip(walks, _walk_all([src for _, _, src in walks], CHUNK_BYTES)):
        out[name] = _print_from(t, walked)
    return PendingPrints(out, [n for n, _ in on_device], DevicePrints([t for _, t in on_device], masked))


def _kernel_input(t: torch.Tensor) -> _KernelInput | None:
    """What the walk reads of a non-empty CPU tensor of the statistics kernel's dtypes (a contiguous
    copy if it is not contiguous), else None (fingerprinted by :func:`_print`'s other paths). The walk
    (:func:`_walk_all`) takes :data:`CHUNK_BYTES` pieces, each hashed (streamed: the xxh3-128 digest of
    the whole) and then summarised by ``accuracy.fused``'s statistics kernel, continuing one head:
    sum, L2 and absmax over the finite values are the numbers a single pass gives, whatever the chunk."""
    try:
        if not _printable(t) or t.dtype not in KERNEL_DTYPES or not t.numel():
            return None
        data = t.detach().resolve_conj().resolve_neg()
        return _KernelInput.of(data.contiguous()) if data.is_cpu else None
    except (RuntimeError, TypeError):  # a tensor subclass that cannot be read: _print decides
        return None


def _on_accelerator(t: torch.Tensor) -> bool:
    try:
        return not t.is_cpu and not t.is_meta
    except (RuntimeError, TypeError):
        return False


def _guarded_print(t: torch.Tensor) -> TensorPrint | None:
    try:
        return _print(t)
    except (RuntimeError, TypeError):  # a tensor subclass that cannot be read: not fingerprinted
        return None


#: Where the walk runs in Python (:func:`_xxh3` is None; the compiled walk takes CHUNK_BYTES with no
#: GIL between them): bytes a background walk hashes, then summarises, at a time: few pieces, so that the thread asks
#: for the GIL seldom while the forward pass (Python-bound under a dispatch mode) holds it, yet small
#: enough that the statistics' second read comes from the core's L2 (docs/capture.md has the measurements).
BACKGROUND_CHUNK_BYTES = 1 << 20
assert BACKGROUND_CHUNK_BYTES % CHUNK_BYTES == 0
#: Weights under this size are walked at once, on the caller's thread: a small walk does not repay
#: handing it to the thread (docs/capture.md).
BACKGROUND_MIN_BYTES = 2 << 20


class ParameterPrints:
    """:func:`parameter_prints` of the model as it is now, the weights' walks run on a background
    thread: the digest and the statistics kernel take no torch op and release the GIL, so on a
    machine with a spare core they overlap the captured forward pass instead of delaying it.

    Contiguous CPU tensors of the statistics kernel's dtypes that have a version counter go to the
    thread; every other tensor is fingerprinted here, at once. The walks read the weights while the
    model runs, so call :meth:`result` before anything writes into them: the ``aten`` level's dispatch
    mode calls it before the first op that writes in place, ``capture.paused()`` before its block.
    A weight whose version counter or address changed anyway (a write no mode saw, e.g. from
    another thread) is fingerprinted again as it is at :meth:`result`, and said so in ``notes``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._prints: dict[str, TensorPrint | None] = {}  # walk order; None until the thread fills it
        self._later: list[tuple[str, torch.Tensor, _KernelInput, int]] = []
        self._walked: dict[str, tuple[str, np.ndarray]] = {}
        self._error: BaseException | None = None
        self.notes: list[str] = []
        now: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, t in _parameters_and_buffers(model):
                later = _background_input(t)
                self._prints[name] = None
                if later is None:
                    now.append((name, t))
                else:
                    self._later.append((name, t, *later))
            self._prints.update(_prints_of(now).read())
        self._thread: threading.Thread | None = None
        if self._later:
            self._thread = threading.Thread(target=self._run, name="opband-fingerprints", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            walked = _walk_all([src for _, _, src, _ in self._later], BACKGROUND_CHUNK_BYTES)
            self._walked.update((name, w) for (name, *_), w in zip(self._later, walked))
        except BaseException as e:  # noqa: BLE001 - reported by result(), which redoes the rest here
            self._error = e

    def result(self) -> dict[str, TensorPrint]:
        """Wait for the thread; every fingerprint by name (the tensors it could not read left out)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                self.notes.append(f"parameter fingerprints: the background walk failed ({type(self._error).__name__}: "
                                  f"{self._error}); the rest were fingerprinted when it was collected (at the "
                                  "capture's first in-place write or its end)")
            changed = []
            with torch.no_grad():
                for name, t, src, version in self._later:
                    walked = self._walked.get(name)
                    if walked is not None and version_of(t) == version and t.data_ptr() == src.addr:
                        self._prints[name] = _print_from(t, walked)
                    else:
                        if walked is not None:
                            changed.append(name)
                        self._prints[name] = _guarded_print(t)
            if changed:
                self.notes.append(f"parameter fingerprints: {len(changed)} weight(s) changed during the capture "
                                  f"without an op the capture saw (first: {changed[0]}); they describe the weights "
                                  "when the walk was collected (the capture's first in-place write or its end)")
            self._later = []
        return {name: fp for name, fp in self._prints.items() if fp is not None}


def _background_input(t: torch.Tensor) -> tuple[_KernelInput, int] | None:
    """What the background walk reads of ``t`` and its version now, or None to fingerprint it at once."""
    try:
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_cpu or t.layout != torch.strided
                or t.is_nested or t.dtype not in KERNEL_DTYPES or t.numel() * t.element_size() < BACKGROUND_MIN_BYTES
                or not t.is_contiguous()
                or t.is_conj() or t.is_neg()):
            return None
        version = version_of(t)
        if version is None:
            return None
        return _KernelInput.of(t.detach()), version
    except (RuntimeError, TypeError):
        return None


def _parameters_and_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``list(model.named_parameters()) + list(model.named_buffers())`` in one walk of the modules
    (each walk costs ~1 us per module): the same names, order and de-duplication. A model that
    overrides either method (FSDP renames parameters) is asked as before."""
    cls = type(model)
    if cls.named_parameters is not torch.nn.Module.named_parameters or cls.named_buffers is not torch.nn.Module.named_buffers:
        return list(model.named_parameters()) + list(model.named_buffers())
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    seen_params: set[torch.Tensor] = set()
    seen_buffers: set[torch.Tensor] = set()
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        for members, seen, found in ((module._parameters, seen_params, params), (module._buffers, seen_buffers, buffers)):
            for key, value in members.items():
                if value is None or value in seen:
                    continue
                seen.add(value)
                found.append((dot + key, value))
    return params + buffers
