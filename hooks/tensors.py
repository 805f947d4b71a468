"""What capture stores for one tensor: its payload bytes, its dtype name, its statistics.

:func:`unsupported_reason` says why a tensor cannot be stored (it is then skipped with that reason);
:func:`stored_payload` encodes the others, by kind of value: floating and integer tensors as they
are, BF16/FP8 as raw words, quantized tensors dequantized with their qparams, complex tensors as
``view_as_real`` (:func:`plain_payload` is its fast path for the first kind). The dtypes, their bundle
tags and the statistics row's layout come from :mod:`accuracy.capture_format`.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from accuracy import fused
from accuracy.capture_format import DTYPES, KERNEL_DTYPES as _KERNEL_NAMES, ROW_LENGTH, SAMPLE_SIZE, STAT_COUNTS, STAT_FIELDS
from hooks import native_module

#: Ops that move no numbers: views, reshapes, aliasing, metadata. Skipped and counted by default.
NO_NUMBER_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.detach", "aten.alias",
    "aten.as_strided", "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.chunk",
    "aten.unbind", "aten.flatten", "aten.unflatten", "aten.view_as", "aten.expand_as", "aten.lift_fresh",
    "aten.clone", "aten.contiguous", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_same_size", "aten._local_scalar_dense",
    "aten.item", "aten.new_empty", "aten.new_empty_strided", "aten.set_", "aten.resize_", "aten.narrow",
    "aten.movedim", "aten.diagonal", "aten.unfold", "aten.real", "aten.imag", "aten.view_as_real",
    "aten.view_as_complex", "aten._has_compatible_shallow_copy_type", "aten.lift_fresh_copy",
    "aten._conj", "aten._neg_view", "aten.conj", "aten.resolve_conj", "aten.resolve_neg",
    "aten.empty_permuted", "aten._reshape_copy",
})

#: torch dtype -> the bundle tag its values are stored under as they are
_TAGS = {getattr(torch, d.name): d.tag for d in DTYPES.values() if d.tag is not None}
#: bundle tag -> torch dtype, for tags whose values are stored as raw words (BF16, FP8)
RAW_TAG_DTYPES = {d.tag: getattr(torch, d.name) for d in DTYPES.values()
                  if d.tag is not None and d.storage is not None and d.storage.kind == "u" and d.name != "uint8"}
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
#: dtypes whose bytes are stored as they are: dtype -> (tag, dtype name)
_AS_IS = {d: (tag, str(d).removeprefix("torch.")) for d, tag in _TAGS.items() if d not in _RAW_VIEW}


def dtype_tag(dtype: torch.dtype) -> str | None:
    """The bundle's dtype tag a tensor of ``dtype`` is stored under as it is (``F32``, ``BF16`` …), or None."""
    return _TAGS.get(dtype)


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or None when it has none (inference tensors): no matching."""
    if t.is_inference():
        return None
    return t._version


#: dtype -> name without the ``torch.`` prefix, filled by :func:`tensor_dtype_name`
DTYPE_NAMES: dict[torch.dtype, str] = {}


def tensor_dtype_name(t: torch.Tensor) -> str:
    """``float32``, ``bfloat16``, ``qint8`` …: the dtype name without the ``torch.`` prefix."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    return name


def fast_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in ``tree_leaves`` order. A tensor, or a tuple or list of
    tensors and plain scalars (ATen outputs, most modules' arguments) without the generic pytree
    walk, which also handles every other registered node."""
    kind = type(tree)
    if kind is torch.Tensor:
        return [tree]
    if kind is tuple or kind is list:
        out = []
        for t in tree:
            if type(t) is torch.Tensor:
                out.append(t)
            elif type(t) not in _ATOMS:
                break
        else:
            return out
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


#: leaves that are never pytree nodes and never tensors
_ATOMS = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device})


def unsupported_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be captured (sparse, nested, meta, subclass …), or None when it can."""
    if getattr(t, "is_nested", False):
        return "nested tensors are not captured"
    if t.layout != torch.strided:
        return f"layout {t.layout} is not captured"
    if t.is_meta:
        return "meta tensors have no values"
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, torch.nn.parameter.Buffer):
        return f"tensor subclass {type(t).__name__} is not captured"
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return "functorch-wrapped tensors (vmap/grad transforms) are not captured"
    if t.is_quantized or t.dtype in _TAGS or t.dtype in _COMPLEX:
        return None
    return f"dtype {t.dtype} has no bundle encoding"


def storage_key(data: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a contiguous non-empty tensor's bytes live: (storage identity, offset, numel, dtype).

    Two tensors with equal keys hold the same elements in the same order, whatever their shapes.
    The identity is the address of the storage's ``StorageImpl``; a :class:`StorageMap` entry holds
    a weak reference to it, which keeps a freed storage's address from being reused while the
    entry lives: a match is the very same memory, never a recycled address. (Plain integers hash
    and compare in C; ``StorageWeakRef`` keys would run Python ``__init__``/``__eq__`` per op.)"""
    if data.numel() == 0 or not data.is_contiguous() or data.is_meta:
        return None
    return data.untyped_storage()._cdata, data.storage_offset(), data.numel(), data.dtype


class _Pin:
    """A weak reference to a storage (what ``StorageWeakRef`` holds): while it lives, the storage's
    ``StorageImpl`` memory, and so its address, is not reused."""

    __slots__ = ("cdata",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata = storage._weak_ref()

    def expired(self) -> bool:
        return bool(torch.UntypedStorage._expired(self.cdata))

    def __del__(self) -> None:
        torch.UntypedStorage._free_weak_ref(self.cdata)


class StorageMap:
    """A dict keyed by :func:`storage_key`; entries of freed storages go once it has doubled."""

    def __init__(self) -> None:
        self._d: dict[tuple[Any, ...], tuple[_Pin, Any]] = {}
        self._limit = 1024

    def get(self, key: tuple[Any, ...]) -> Any:
        hit = self._d.get(key)
        return hit[1] if hit is not None else None

    def put(self, key: tuple[Any, ...], value: Any, data: torch.Tensor) -> None:
        """``key`` must be ``storage_key(data)``: the entry pins ``data``'s storage identity."""
        old = self._d.get(key)
        self._d[key] = (old[0] if old is not None else _Pin(data.untyped_storage()), value)
        if len(self._d) > self._limit:
            self._d = {k: v for k, v in self._d.items() if not v[0].expired()}
            self._limit = max(1024, 2 * len(self._d))

    def __len__(self) -> int:
        return len(self._d)


class Payload:
    """What is stored for one captured tensor: the bytes' tensor, its tag, dtype, shape, extras."""

    __slots__ = ("tensor", "tag", "dtype", "shape", "extra", "values")

    def __init__(self, tensor: torch.Tensor, tag: str, dtype: str, extra: dict[str, Any] | None,
                 values: torch.Tensor) -> None:
        self.tensor = tensor  # whose bytes go to the bundle (same shape as ``shape``)
        self.tag = tag
        self.dtype = dtype  # the record's dtype name
        self.shape = list(tensor.shape)
        self.extra = extra  # qparams / complex layout, stored under Record.qparams
        self.values = values  # numeric values the statistics are taken over


_STRIDED = torch.strided
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_payload(t: torch.Tensor) -> Payload | None:
    """:func:`stored_payload` of a plain dense tensor stored as it is (most outputs: float32, bf16 is not),
    with :func:`unsupported_reason`'s checks in one pass; None for anything else (take the generic path)."""
    if type(t) is not torch.Tensor:
        return None
    as_is = _AS_IS.get(t.dtype)
    if as_is is None or t.layout is not _STRIDED or t.is_nested or t.is_meta or _functorch_wrapped(t):
        return None
    if t.requires_grad:
        t = t.detach()
    return Payload(t, as_is[0], as_is[1], None, t)


def stored_payload(t: torch.Tensor) -> Payload:
    """Encode ``t`` (already checked by :func:`unsupported_reason`) for the bundle."""
    if t.requires_grad:
        t = t.detach()
    as_is = _AS_IS.get(t.dtype)
    if as_is is not None:  # most tensors: stored as they are
        return Payload(t, as_is[0], as_is[1], None, t)
    if t.is_quantized:
        qparams: dict[str, Any] = {"qscheme": str(t.qscheme()).removeprefix("torch."), "dtype": tensor_dtype_name(t)}
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            qparams.update(scale=float(t.q_scale()), zero_point=int(t.q_zero_point()))
        else:
            qparams.update(axis=int(t.q_per_channel_axis()),
                           scales=t.q_per_channel_scales().tolist(), zero_points=t.q_per_channel_zero_points().tolist())
        deq = t.dequantize()
        return Payload(deq, "F32", tensor_dtype_name(t), qparams, deq)
    real = _COMPLEX.get(t.dtype)
    if real is not None:
        as_real = torch.view_as_real(t.resolve_conj().resolve_neg())
        extra = {"complex": tensor_dtype_name(t), "layout": "view_as_real"}
        return Payload(as_real, _TAGS[real], tensor_dtype_name(as_real), extra, as_real)
    raw = _RAW_VIEW.get(t.dtype)
    if raw is not None:
        return Payload(t.contiguous().view(raw), _TAGS[t.dtype], tensor_dtype_name(t), None, t)
    return Payload(t, _TAGS[t.dtype], tensor_dtype_name(t), None, t)


class StatsBatch:
    """Per-tensor statistics. CPU rows are host lists; accelerator rows stay on the device until
    :meth:`to_host`, which moves all of them in one transfer per device (no sync per op).

    A tensor whose bytes were summarised already reuses that row: the same tensor at the same
    version, a contiguous view of it, or (when ``epochs`` are tracked, i.e. a dispatch mode sees
    every write) any contiguous alias of the same memory with no in-place op since, such as a
    module output that is ``_unsafe_view`` of the last ``mm``.
    """

    def __init__(self, epochs: bool = False) -> None:
        self._rows: list[torch.Tensor | list[float]] = []
        self._seen: dict[Any, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], int]] = {}
        self._at = StorageMap()  # with epochs: storage_key -> (epoch, slot)
        self.epochs = epochs
        self.epoch = 0  # bumped by the dispatch mode on every op that writes in place
        # with epochs: rows summarised elsewhere (hooks.observer's compiled path), by the tensor
        self.lookup: Callable[[torch.Tensor], list[float] | None] | None = None

    def add(self, values: torch.Tensor, original: torch.Tensor | None = None) -> int | None:
        """Summarise ``values`` (the numbers of ``original``, the live tensor); returns its slot.

        ``original=None`` disables matching (the tensor was just written in place)."""
        if values.numel() == 0:
            return None
        where = seen = row = None
        if original is not None:
            t = values if original.dtype != values.dtype else original
            if self.epochs:
                where = storage_key(t)
                hit = self._at.get(where) if where is not None else None
                if hit is not None and hit[0] == self.epoch and self._unchanged(values, hit[1]):
                    return hit[1]
                if self.lookup is not None and where is not None:
                    row = self.lookup(t)  # summarised by the compiled observer, or None
            else:
                seen = self._version_key(t)
                prior = self._seen.get(seen[0]) if seen is not None else None
                if seen is not None and prior is not None and prior[0]() is not None and prior[1] == seen[2]:
                    return prior[2]
        if row is None:
            row = host_stats(values) if values.is_cpu else device_stats(values)
        self._rows.append(row)
        slot = len(self._rows) - 1
        if where is not None:
            self._at.put(where, (self.epoch, slot), t)
        elif seen is not None:
            self._seen[seen[0]] = (weakref.ref(seen[1]), seen[2], slot)
        return slot

    def _unchanged(self, values: torch.Tensor, slot: int) -> bool:
        """A host row's sampled elements still hold their values in ``values``: a guard against
        writes the dispatch mode never sees (a raw Triton/C kernel or numpy writing through the
        data pointer). Device rows are trusted (checking would sync the device)."""
        row = self._rows[slot]
        if not isinstance(row, list):
            return True
        n = values.numel()
        if int(row[0]) != n:
            return False
        idx = _cpu_sample_index(n)  # host rows are CPU tensors
        name = KERNEL_DTYPES.get(values.dtype)
        if name is not None and values.is_contiguous():  # by address, without torch ops
            out = np.empty(idx.numel())
            fused.SAMPLE_AT[name](values.data_ptr(), idx.data_ptr(), idx.numel(), out)
            live = out.tolist()
        else:
            live = values.reshape(-1).index_select(0, idx).to(torch.float64).tolist()
        stored = row[len(STAT_FIELDS): len(STAT_FIELDS) + len(live)]
        return live == stored or all(a == b or (a != a and b != b) for a, b in zip(live, stored, strict=True))

    @staticmethod
    def _version_key(t: torch.Tensor) -> tuple[Any, torch.Tensor, tuple[Any, ...]] | None:
        """Without epochs: (id of the base, base to hold weakly, state that must match) or None."""
        version = version_of(t)
        if version is None or not t.is_contiguous():
            return None
        base = t._base if t._base is not None else t
        return id(base), base, (t.storage_offset(), t.numel(), t.dtype, version)

    def to_host(self) -> list[dict[str, Any]]:
        """One statistics dict per slot, in slot order."""
        host: list[list[float] | None] = [r if isinstance(r, list) else None for r in self._rows]
        by_device: dict[torch.device, list[int]] = {}
        for i, row in enumerate(self._rows):
            if isinstance(row, torch.Tensor):
                by_device.setdefault(row.device, []).append(i)
        for idxs in by_device.values():
            stacked = torch.stack([self._rows[i] for i in idxs]).to("cpu", torch.float64)  # type: ignore[misc]
            for i, row in zip(idxs, stacked.tolist(), strict=True):
                host[i] = row
        return [_row_dict(row) for row in host if row is not None]


_N_HEAD = len(STAT_FIELDS)
#: per field of the row's head: its name and whether it is a count (an int in ``Stats``)
_HEAD = tuple((name, name in STAT_COUNTS) for name in STAT_FIELDS)


def _row_dict(vals: list[float]) -> dict[str, Any]:
    """A statistics row as ``Stats`` fields (counts as ints, the sample cut to ``numel``)."""
    out: dict[str, Any] = {name: int(v) if count else v for (name, count), v in zip(_HEAD, vals)}
    out["sample"] = vals[_N_HEAD:_N_HEAD + min(SAMPLE_SIZE, out["numel"])]
    return out


_SAMPLE_INDEX: dict[tuple[int, torch.device, int | None], torch.Tensor] = {}  # by (numel, device, CUDA stream)
_CPU_SAMPLE_INDEX: dict[int, torch.Tensor] = {}  # the same for CPU, by numel alone (hashing a device costs)
_CPU = torch.device("cpu")


def _cpu_sample_index(n: int) -> torch.Tensor:
    idx = _CPU_SAMPLE_INDEX.get(n)
    if idx is None:
        if len(_CPU_SAMPLE_INDEX) > 4096:
            _CPU_SAMPLE_INDEX.clear()
        idx = _CPU_SAMPLE_INDEX[n] = _sample_index(n, _CPU)
    return idx


def _sample_index(n: int, device: torch.device) -> torch.Tensor:
    """``SAMPLE_SIZE`` evenly spaced flat indices (cached: shapes repeat across layers). The float32
    ``linspace`` may round past the last element for some ``n`` beyond 2**24: clamped to ``n - 1``.
    On CUDA one per stream, made on it: a launch on another stream could read it before it is written."""
    key = (n, device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None)
    idx = _SAMPLE_INDEX.get(key)
    if idx is None:
        if len(_SAMPLE_INDEX) > 4096:
            _SAMPLE_INDEX.clear()
        idx = _SAMPLE_INDEX[key] = (
            torch.linspace(0, n - 1, min(SAMPLE_SIZE, n), device=device).round().long().clamp_max(n - 1))
    return idx


def host_stats(values: torch.Tensor) -> list[float]:
    """Statistics of a CPU tensor as a host list, in one pass over its memory.

    :mod:`accuracy.fused`'s statistics kernel (numba; the same module as the metric suite) reads
    float32/float64 values and BF16/F16 words where they lie, by address, without a copy (also a
    dense permuted tensor, in storage order); min, max, sum, sum of squares, the zero count and the
    non-finite counts come from that one pass (a block holding NaN/Inf is redone masked: the
    statistics are then over the finite values, as in :func:`device_stats`). Integer tensors are
    converted to float64 first, other non-contiguous ones copied. ``absmax`` is ``max(-min, max)``;
    std comes from the two sums, with a centred second pass when the mean is so large against the
    spread that ``E[x^2] - E[x]^2`` would cancel. CPU values are already on the host: no device sync.
    """
    if values.dtype == torch.bool:
        return _bool_stats(values)
    x = values
    name = KERNEL_DTYPES.get(x.dtype)
    if name is None:
        x, name = x.reshape(-1).to(torch.float64), "float64"
    n = x.numel()
    if n == 0:
        return [0.0, math.inf, -math.inf, 0.0, 0.0, 0.0, -math.inf, 0.0, 0.0, 0.0, *([0.0] * SAMPLE_SIZE)]
    idx = _cpu_sample_index(n)
    if not x.is_contiguous():
        where = _dense_offsets(x)
        if where is None:
            x = x.contiguous()
        else:  # a permuted dense tensor: its memory in storage order (from the data pointer), in one pass
            idx = where
    if n < fused.PARALLEL_MIN or torch.get_num_threads() == 1:  # the values where they lie, by address
        out = np.empty(_ROW_LEN)
        fused.ROW_AT[name](x.data_ptr(), n, idx.data_ptr(), idx.numel(), fused.CANCEL[name], out)
    else:
        flat = x.detach().as_strided((n,), (1,))
        arr = (flat.view(torch.int16) if name in ("bfloat16", "float16") else flat).numpy()
        if name == "bfloat16":
            arr = arr.view(np.uint16)
        out = fused.stats_row(arr, idx.numpy(), name, _ROW_LEN, torch.get_num_threads())
    return out.tolist()


#: dtypes the statistics kernel reads in place -> their names
KERNEL_DTYPES = {getattr(torch, name): name for name in _KERNEL_NAMES}
_ROW_LEN = ROW_LENGTH


def _bool_stats(values: torch.Tensor) -> list[float]:
    """A boolean tensor's statistics from its count of ``True`` (one ``count_nonzero``)."""
    n = values.numel()
    nz = int(torch.count_nonzero(values))
    mean = nz / n
    sample = values.reshape(-1).index_select(0, _sample_index(n, values.device)).to(torch.float64).tolist()
    return [float(n), 0.0 if nz < n else 1.0, 1.0 if nz else 0.0, mean, math.sqrt(max(mean - mean * mean, 0.0)),
            math.sqrt(nz), 1.0 if nz else 0.0, 0.0, 0.0, float(n - nz), *sample, *([0.0] * (SAMPLE_SIZE - len(sample)))]


_DENSE: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor | None] = {}


def _dense_offsets(x: torch.Tensor) -> torch.Tensor | None:
    """For a non-contiguous tensor whose elements fill ``numel`` consecutive slots from its data
    pointer (a permutation of a contiguous one, e.g. ``transpose(1, 2)`` then an elementwise op):
    the storage offsets of the sample elements. None when it has gaps or overlaps (cached per layout)."""
    shape, stride = tuple(x.shape), tuple(x.stride())
    key = (shape, stride)
    if key in _DENSE:
        return _DENSE[key]
    expected, dense = 1, True
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz != 1):
        if st != expected:
            dense = False
            break
        expected *= sz
    where = None
    if dense:
        offsets = []
        for flat in _sample_index(x.numel(), torch.device("cpu")).tolist():
            off = 0
            for sz, st in zip(reversed(shape), reversed(stride), strict=True):
                flat, i = divmod(flat, sz)
                off += i * st
            offsets.append(off)
        where = torch.tensor(offsets, dtype=torch.int64)
    if len(_DENSE) > 4096:
        _DENSE.clear()
    _DENSE[key] = where
    return where




def device_stats(values: torch.Tensor) -> torch.Tensor:
    """One float row on the device, without host syncs: numel, min, max, mean, std, l2, absmax,
    nan, inf, zeros (over finite values; NaN/Inf counted), then a padded sample.

    float32/16/bf16, integer and bool CUDA tensors take the compiled kernel where ``hooks._observer`` was
    built with CUDA (``hooks/native/stats_cuda.cu``, launched from C++: the observer's own, so both engines
    write the same rows), else Triton (:mod:`hooks.triton_stats`: one launch up to 256K elements, two
    beyond); float64 and complex ones, or all with ``OPBAND_DEVICE_STATS=torch``, about 25 torch ops
    (:func:`torch_device_stats`). ``OPBAND_DEVICE_STATS=triton`` skips the compiled kernel."""
    global _TRITON_BROKEN
    compiled = _compiled_cuda() if values.is_cuda and values.numel() else None
    if compiled is not None and values.dtype in _COMPILED_DTYPES and type(values) in (torch.Tensor, torch.nn.Parameter):
        return compiled.cuda_stats_row(values, _sample_index(values.numel(), values.device), SAMPLE_SIZE)
    if values.numel() and _TRITON_BROKEN is None:
        try:
            if _use_triton(values):
                return _triton_stats().stats_row(values, _sample_index(values.numel(), values.device), SAMPLE_SIZE)
        except Exception as e:  # noqa: BLE001 - a Triton that cannot compile here: the torch path, said once
            _TRITON_BROKEN = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            warnings.warn(f"opband: on-device statistics fall back to torch ops (slower): Triton failed "
                          f"({_TRITON_BROKEN})", RuntimeWarning, stacklevel=2)
    return torch_device_stats(values)


_TRITON_BROKEN: str | None = None

#: the dtypes hooks/native/stats_cuda.cu reads (hooks.triton_stats.DTYPES)
_COMPILED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                              torch.int8, torch.uint8, torch.bool})


@functools.cache
def _compiled_cuda() -> Any:
    """``hooks._observer`` when it was built with CUDA for this torch and ``OPBAND_DEVICE_STATS`` allows it, else None."""
    if os.environ.get("OPBAND_DEVICE_STATS") in ("torch", "triton"):
        return None
    return native_module.with_cuda()


def _use_triton(values: torch.Tensor) -> bool:
    """Whether ``values`` may take the Triton kernels (callers check ``_TRITON_BROKEN`` first)."""
    if os.environ.get("OPBAND_DEVICE_STATS") == "torch":
        return False
    if values.is_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _triton_stats().usable_for(values)


@functools.cache
def _triton_stats() -> Any:
    """:mod:`hooks.triton_stats`, imported at the first accelerator tensor (Triton takes ~1 s to import)."""
    from hooks import triton_stats

    return triton_stats


def torch_device_stats(values: torch.Tensor) -> torch.Tensor:
    """:func:`device_stats` as torch ops: any dtype and device, ~25 kernel launches."""
    x = values.reshape(-1)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(acc)
    n = x.numel()
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    count = finite.sum().to(acc)
    lo = torch.where(finite, x, float("inf")).min()
    hi = torch.where(finite, x, float("-inf")).max()
    mean = xf.sum() / count.clamp_min(1)
    var = ((xf - mean) * finite).pow(2).sum() / count.clamp_min(1)
    l2 = xf.square().sum().sqrt()  # a cascade/tree sum: vector_norm and BLAS dot drift by 1e-5 on CPU
    absmax = torch.maximum(-lo, hi)
    nan = torch.isnan(x).sum().to(acc)
    inf = (~finite).sum().to(acc) - nan
    zeros = (x == 0).sum().to(acc)
    sample = x.index_select(0, _sample_index(n, x.device))
    if sample.numel() < SAMPLE_SIZE:  # rows are stacked later: pad, the numel field says how many are real
        sample = torch.cat([sample, torch.zeros(SAMPLE_SIZE - sample.numel(), dtype=acc, device=x.device)])
    numel = torch.full((), float(n), dtype=acc, device=x.device)
    return torch.cat([torch.stack([numel, lo, hi, mean, var.sqrt(), l2, absmax, nan, inf, zeros]), sample])
