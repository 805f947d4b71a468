"""The tensor table: the bundle's dtypes and tags, each tensor's entry (:class:`TensorInfo`) in a compact
columnar :class:`TensorTable`, and decoding stored arrays (BF16, FP8) to numpy."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from accuracy.capture_format import BY_TAG
from accuracy.errors import BundleError


#: safetensors dtype tag -> (numpy storage dtype, element size), from the format's one registry
#: (:data:`accuracy.capture_format.BY_TAG`, in tag-code order). BF16 and F8 are stored raw.
DTYPES: dict[str, tuple[np.dtype, int]] = {tag: (d.storage, d.itemsize) for tag, d in BY_TAG.items()
                                           if d.storage is not None}
_TAG_NAMES: tuple[str, ...] = tuple(DTYPES)


_TAG_CODES = {tag: code for code, tag in enumerate(_TAG_NAMES)}


#: Record dtype name -> the tag its tensor must be stored with (quantized dtypes store F32 values).
RECORD_DTYPE_TAG: dict[str, str] = {d.name: tag for tag, d in BY_TAG.items()}
_META_FORMAT = "format"


_META_MANIFEST = "opband.manifest"


#: The tensor that holds a format-2 bundle's records: UTF-8 JSON, one record per line, each ended by
#: ``\n``; the writer puts it last in the data buffer. Names under ``__opband__/`` are opband's own.
RECORDS_TENSOR = "__opband__/records"


RESERVED_PREFIX = "__opband__/"


#: a tensor table of at most this many tensors is also indexed by a dict (~100 bytes a tensor)
DICT_TENSORS = 50_000


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives in the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class TensorTable(Mapping[str, TensorInfo]):
    """The header's tensor entries, name -> :class:`TensorInfo`, as numpy columns: ~45 bytes a tensor
    plus its name's UTF-8 bytes (a dict of TensorInfo costs ~350), so a bundle of a million tensors
    opens in flat memory. Lookups go by a 64-bit hash of the name, confirmed on the name itself.
    Iterates in data-buffer order."""

    def __init__(self) -> None:
        self._names = bytearray()
        self._cols = {k: array(t) for k, t in (("begin", "q"), ("end", "q"), ("dtype", "b"), ("shape", "i"),
                                               ("name_at", "q"), ("hash", "q"))}
        self._shapes: dict[tuple[int, ...], int] = {}
        self._hidden = -1
        self._recent: dict[str, TensorInfo] = {}  # the last few looked up (a comparison asks for each twice)
        self._by_name: dict[str, int] | None = None  # set by freeze() for small tables
        self._name_list: list[str] | None = []  # the names as str while there are at most DICT_TENSORS

    def add(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        """One entry (see :meth:`extend`)."""
        self.extend((name,), (dtype,), (shape,), (begin,), (end,))

    def extend(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
               begins: Sequence[int], ends: Sequence[int]) -> None:
        """Add entries, in order (a header's run of canonical entries: one list operation per column)."""
        c = self._cols
        c["begin"].extend(begins)
        c["end"].extend(ends)
        c["dtype"].extend([_TAG_CODES[t] for t in dtypes])
        known = self._shapes
        c["shape"].extend([known.setdefault(shape, len(known)) for shape in shapes])
        encoded = [n.encode("utf-8", "surrogatepass") for n in names]
        c["name_at"].extend(itertools.accumulate(map(len, encoded[:-1]), initial=len(self._names)))
        c["hash"].extend(map(hash, names))
        self._names += b"".join(encoded)
        if self._name_list is not None:
            self._name_list.extend(names)
            if len(self._name_list) > DICT_TENSORS:
                self._name_list = None

    def freeze(self) -> TensorTable:
        """Columns to numpy (after the last :meth:`add`); order by data offset; index the hashes."""
        cols = {k: np.frombuffer(v, dtype=v.typecode).copy() if len(v) else np.zeros(0, v.typecode)
                for k, v in self._cols.items()}
        self._cols = {}
        # read one element at a time through memoryviews: a Python int each, cheaper than a numpy scalar
        self._name_at = memoryview(np.append(cols["name_at"], len(self._names)))  # name i: bytes [at[i], at[i + 1])
        self.order = np.lexsort((cols["end"], cols["begin"])).astype(np.int32)  # data order, as the buffer is checked
        self.begin, self.end, self.dtype, self.shape = cols["begin"], cols["end"], cols["dtype"], cols["shape"]
        self.shapes = [s for s, _ in sorted(self._shapes.items(), key=lambda kv: kv[1])]
        self._shapes = {}
        by_hash = np.argsort(cols["hash"], kind="stable")
        self._hash_keys, self._hash_slots = cols["hash"][by_hash], by_hash.astype(np.int32)
        self._hash_col, self._last = memoryview(cols["hash"]), -1
        # a table of few tensors also keeps a plain dict (and plain columns): a dict lookup beats a hash search there
        if self._name_list is not None:
            by_name: dict[str, int] = {}
            for slot, name in enumerate(self._name_list):
                by_name.setdefault(name, slot)  # a repeated name: the first, as the hash index finds
            self._by_name = by_name
            self._plain = (self.begin.tolist(), self.end.tolist(), self.dtype.tolist(), self.shape.tolist())
        else:
            self._plain = (memoryview(self.begin), memoryview(self.end), memoryview(self.dtype), memoryview(self.shape))
        return self

    def name(self, slot: int) -> str:
        if self._name_list is not None:
            return self._name_list[slot]
        return bytes(self._names[self._name_at[slot] : self._name_at[slot + 1]]).decode("utf-8", "surrogatepass")

    def slot(self, name: str) -> int | None:
        """The slot of ``name`` (its position in the header), or None."""
        if self._by_name is not None:
            slot = self._by_name.get(name)
            return None if slot is None or slot == self._hidden else slot
        h = hash(name)
        guess = self._last + 1  # lookups mostly go in header order (records name their tensors in order)
        if guess < len(self._hash_col) and self._hash_col[guess] == h and guess != self._hidden and self.name(guess) == name:
            self._last = guess
            return guess
        lo = int(self._hash_keys.searchsorted(h))
        while lo < len(self._hash_keys) and self._hash_keys[lo] == h:
            slot = int(self._hash_slots[lo])
            if slot != self._hidden and self.name(slot) == name:
                self._last = slot
                return slot
            lo += 1
        return None

    def info(self, slot: int, name: str | None = None) -> TensorInfo:
        """The entry at ``slot`` (``name``: its name, when the caller has it already)."""
        if name is None:
            name = self.name(slot)
        begin, end, dtype, shape = self._plain  # lists, or memoryviews of the columns
        return TensorInfo(name, _TAG_NAMES[dtype[slot]], self.shapes[shape[slot]], begin[slot], end[slot])

    def hide(self, name: str) -> TensorInfo | None:
        """Take ``name`` out of the mapping (the records tensor: opband's own); its info, or None."""
        slot = self.slot(name)
        if slot is None:
            return None
        self._hidden = slot
        self._recent.pop(name, None)
        return self.info(slot)

    def duplicate_name(self) -> str | None:
        """A name the header gives twice, if any (equal hashes, confirmed on the names)."""
        keys = self._hash_keys
        for k in np.unique(keys[1:][keys[1:] == keys[:-1]]):
            lo, hi = np.searchsorted(keys, k, "left"), np.searchsorted(keys, k, "right")
            names = [self.name(int(s)) for s in self._hash_slots[lo:hi]]
            repeated = [n for n in names if names.count(n) > 1]
            if repeated:
                return repeated[0]
        return None

    def __getitem__(self, name: str) -> TensorInfo:
        info = self._recent.get(name)
        if info is None:
            slot = self.slot(name)
            if slot is None:
                raise KeyError(name)
            info = self.info(slot, name)
            if self._by_name is None and len(self._recent) >= 64:  # a small table keeps every one looked up
                self._recent.clear()
            self._recent[name] = info
        return info

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """``self[name]``, or ``default`` (without ``Mapping.get``'s exception round trip on a hit)."""
        info = self._recent.get(name)
        if info is not None:
            return info
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._recent or self.slot(name) is not None)

    def __iter__(self) -> Iterator[str]:
        for slot in self.order:
            if slot != self._hidden:
                yield self.name(int(slot))

    def __len__(self) -> int:
        return len(self.order) - (self._hidden >= 0)

    def __repr__(self) -> str:
        return f"<TensorTable of {len(self)} tensors>"


def numpy_tag(dtype: np.dtype) -> str:
    """safetensors tag for a numpy dtype."""
    for tag, (np_dtype, _) in DTYPES.items():
        if tag in ("BF16", "F8_E4M3", "F8_E5M2"):
            continue
        if np.dtype(dtype).newbyteorder("<") == np_dtype or np.dtype(dtype) == np_dtype:
            return tag
    raise BundleError(f"numpy dtype {dtype} has no bundle tag")


def decode(raw: np.ndarray, tag: str) -> np.ndarray:
    """Decode a stored array to a numpy numeric array (BF16 and F8 become float32)."""
    if tag == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if tag in ("F8_E4M3", "F8_E5M2"):
        return _decode_fp8(raw, tag)
    return raw


def _fp8_table(tag: str) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    if tag == "F8_E4M3":
        exp_bits, man_bits, bias = 4, 3, 7
    else:
        exp_bits, man_bits, bias = 5, 2, 15
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    normal = (1 + man / (1 << man_bits)) * np.exp2(exp.astype(np.float64) - bias)
    subnormal = (man / (1 << man_bits)) * np.exp2(1.0 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << exp_bits) - 1
    if tag == "F8_E4M3":  # e4m3fn: no infinities, only S.1111.111 is NaN
        values[(exp == top) & (man == 7)] = np.nan
    else:
        values[(exp == top) & (man == 0)] = sign[(exp == top) & (man == 0)] * np.inf
        values[(exp == top) & (man != 0)] = np.nan
    return values.astype(np.float32)


_FP8_TABLES: dict[str, np.ndarray] = {}


def _decode_fp8(raw: np.ndarray, tag: str) -> np.ndarray:
    if tag not in _FP8_TABLES:
        _FP8_TABLES[tag] = _fp8_table(tag)
    return _FP8_TABLES[tag][raw]
