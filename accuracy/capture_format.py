"""The capture format in one place: a record's fields and their order, the statistics row, the dtypes.

Everything that writes or reads records takes these from here: the manifest's pydantic models
(:mod:`accuracy.manifest`), the statistics kernels (:mod:`accuracy.fused`), the metric kernels'
encodings (:mod:`accuracy.metrics`), the bundle's tensor table (:mod:`accuracy.bundle`), the
recorder (:mod:`hooks.tensors`, :mod:`hooks.recorder`) and the compiled observer, which receives
the lists it needs when a capture starts (``hooks/native/observer.cpp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: A record's fields in the order the bundle writes them (``accuracy.manifest.Record``'s order).
RECORD_FIELDS: tuple[str, ...] = (
    "key", "output", "module", "op", "ordinal", "kind", "index", "input_shapes", "input_dtypes", "shape",
    "dtype", "tensor", "input_tensors", "stats", "qparams", "step", "strides", "memory_format",
)

#: The head of a statistics row (``accuracy.manifest.Stats`` without its sample), in the kernels' order.
STAT_FIELDS: tuple[str, ...] = ("numel", "min", "max", "mean", "std", "l2", "absmax", "nan", "inf", "zeros")
#: The fields of :data:`STAT_FIELDS` that are counts (integers in the manifest); the others are floats.
STAT_COUNTS: frozenset[str] = frozenset({"numel", "nan", "inf", "zeros"})
#: Values sampled per tensor at evenly spaced flat indices; they follow the head in a statistics row.
SAMPLE_SIZE = 16


def op_key(module: str, op: str, ordinal: int, step: int = 0) -> str:
    """A record's key: ``module/op#ordinal``, then ``@step`` for step > 0 of a capture whose steps number
    their calls afresh (each call of the model one step: a generation's prefill is step 0, each decode
    step the next). The compiled observer (``hooks/native/observer.cpp``) writes the same keys."""
    return f"{module}/{op}#{ordinal}@{step}" if step else f"{module}/{op}#{ordinal}"


def step_of_key(key: str) -> int:
    """The step an op key names (0 when it names none): the inverse of :func:`op_key`'s suffix."""
    head, mark, tail = key.rpartition("@")
    return int(tail) if mark and "#" in head and tail.isdigit() else 0
#: The length of one statistics row: head, then the sample zero-padded.
ROW_LENGTH = len(STAT_FIELDS) + SAMPLE_SIZE


@dataclass(frozen=True)
class DType:
    """One element type as records name it, bundles store it and kernels read it.

    ``name``: the record's dtype name (torch's, without ``torch.``); ``tag``: the safetensors tag its
    values are stored under (None: a compute format only, e.g. ``tfloat32``); ``storage``: the numpy
    dtype of the stored elements (raw words for bfloat16 and FP8); ``word``: the numpy dtype the
    statistics and error kernels read (None: no kernel reads it as it is); ``kernel``: the index of its
    statistics kernel among :data:`KERNEL_DTYPES` (the compiled observer's row functions), or None;
    ``mantissa``: stored mantissa bits and ``tiny``: smallest normal (floating formats only).
    """

    name: str
    tag: str | None
    storage: np.dtype | None
    word: np.dtype | None = None
    kernel: int | None = None
    mantissa: int | None = None
    tiny: float | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return 0 if self.storage is None else self.storage.itemsize


def _d(code: str) -> np.dtype:
    return np.dtype(code)


#: Every dtype the format knows, by record name.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", "F64", _d("<f8"), _d(np.float64), 1, 52, 2.0**-1022),
    DType("float32", "F32", _d("<f4"), _d(np.float32), 0, 23, 2.0**-126),
    DType("float16", "F16", _d("<f2"), _d(np.int16), 3, 10, 2.0**-14),
    DType("bfloat16", "BF16", _d("<u2"), _d(np.uint16), 2, 7, 2.0**-126),
    DType("float8_e4m3fn", "F8_E4M3", _d("u1"), None, None, 3, 2.0**-6),
    DType("float8_e5m2", "F8_E5M2", _d("u1"), None, None, 2, 2.0**-14),
    DType("int64", "I64", _d("<i8")),
    DType("int32", "I32", _d("<i4")),
    DType("int16", "I16", _d("<i2")),
    DType("int8", "I8", _d("i1")),
    DType("uint8", "U8", _d("u1")),
    DType("bool", "BOOL", _d("?")),
    DType("tfloat32", None, None, None, None, 10, 2.0**-126),
)}

#: The stored dtypes by safetensors tag, in the bundle's tag-code order.
BY_TAG: dict[str, DType] = {d.tag: d for d in DTYPES.values() if d.tag is not None}
#: The dtypes the statistics kernel reads in place, in kernel-code order (``DType.kernel``).
KERNEL_DTYPES: tuple[str, ...] = tuple(sorted((d.name for d in DTYPES.values() if d.kernel is not None),
                                              key=lambda n: DTYPES[n].kernel or 0))
#: Mantissa bits (excluding the implicit one) and smallest normal of each floating dtype.
FLOAT_FORMATS: dict[str, tuple[int, float]] = {
    d.name: (d.mantissa, d.tiny) for d in DTYPES.values() if d.mantissa is not None and d.tiny is not None}


def kernel_word(dtype: str) -> np.dtype | None:
    """The numpy dtype a kernel reads for values stored as ``dtype`` (a record name or a bundle tag)."""
    d = DTYPES.get(dtype) or BY_TAG.get(dtype)
    return None if d is None else d.word
