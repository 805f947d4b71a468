"""The opband bundle: one safetensors file whose ``__metadata__`` carries the JSON manifest.

A bundle is a valid safetensors file, so any safetensors tool can open it. The writer streams
tensor bytes into the final file (behind a reserved, space-padded header region) while the run
proceeds and writes the header on close, so memory never holds more than one tensor (or a few
MiB of small ones) and the data is written once. Records (format 2.0) are JSON lines in the last
tensor of the buffer, ``__opband__/records``: the writer spools them as they come, the reader
validates them one line at a time and keeps a compact index (:class:`accuracy.records.RecordIndex`)
instead of every record, so a bundle of millions of records opens in flat memory. The reader
validates everything strictly (see ``docs/bundle-format.md``), memory-maps tensors and never
unpickles anything.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import mmap
from json.encoder import encode_basestring_ascii as _json_str
import os
import re
import struct
import sys
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from accuracy import writebehind
from accuracy.errors import BundleError
from accuracy.gcpause import paused_gc
from accuracy.manifest import FORMAT_NAME, FORMAT_VERSION, Manifest, Record, RecordsRef, newer_minor, parse_manifest_head, parse_record
from accuracy.records import RecordIndex, RecordList
from accuracy.strictjson import _refuse_constant, _refuse_duplicates

#: Header size limit, as in the safetensors reference implementation.
MAX_HEADER_BYTES = 100_000_000

#: safetensors dtype tag -> (numpy storage dtype, element size). BF16 and F8 are stored raw.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "F8_E4M3": (np.dtype("u1"), 1),
    "F8_E5M2": (np.dtype("u1"), 1),
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("?"), 1),
}

_TAG_NAMES: tuple[str, ...] = tuple(DTYPES)
_TAG_CODES = {tag: code for code, tag in enumerate(_TAG_NAMES)}

#: Record dtype name -> the tag its tensor must be stored with (quantized dtypes store F32 values).
RECORD_DTYPE_TAG: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL",
}

_META_FORMAT = "format"
_META_MANIFEST = "opband.manifest"

#: The tensor that holds a format-2 bundle's records: UTF-8 JSON, one record per line, each ended by
#: ``\n``; the writer puts it last in the data buffer. Names under ``__opband__/`` are opband's own.
RECORDS_TENSOR = "__opband__/records"
RESERVED_PREFIX = "__opband__/"
#: The longest record line a reader accepts (a real record is well under 4 KiB).
MAX_RECORD_BYTES = 1 << 20
#: Bundles with at most this many records keep them as Record objects once opened (``Bundle.records``
#: is a list, as in format 1.x); larger ones keep a compact index and read records from the file.
EAGER_RECORDS = 50_000
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


#: Bundles whose tensor data stays below this size are assembled in memory and written once,
#: with the minimal header padding; larger ones stream to disk after a reserved header region.
SPILL_BYTES = 8 << 20
#: With a writer thread, data streams after this much already (what is held in memory until then is
#: a copy the caller's thread makes, on the model's time); a
#: bundle that ends under ``SPILL_BYTES`` anyway is rewritten without the reservation when it closes.
BACKGROUND_SPILL_BYTES = 1 << 20
#: Smallest header region reserved once data streams to disk (the padding costs at most this).
#: Streaming starts after only ``SPILL_BYTES`` of data, when few records exist yet, while a model's
#: header is ~1 KB per record: 1 MiB holds ~1000 records, so a typical capture never has to grow
#: its header (growing costs a writeback of everything written so far, see ``_insert_range``).
MIN_HEADER_RESERVE = 1 << 20
_BLOCK = 4096  # the data region starts block-aligned, so it can be shifted without a copy


class BundleWriter:
    """Streams tensors and records into a bundle; call :meth:`close` with the manifest to finish.

    Records go either in ``manifest.records`` or, one at a time as they are made, to
    :meth:`add_record` (spooled to a temporary file, so a capture of millions of records holds none
    of them); ``close`` writes the spooled ones first, then the manifest's, as the records tensor.

    Everything goes to ``<path>.partial``, renamed into place by ``close``, so a crashed run never
    leaves a file that looks complete. Small bundles (under ``SPILL_BYTES`` of tensor data) are
    assembled in memory and written in one go. Past that, tensor bytes stream into the file
    behind a reserved header region (sized from the tensors seen so far, see
    :func:`_reserve_for`); ``close`` writes the header into the reservation, padded with spaces,
    so the data is written exactly once. A header that outgrows its reservation makes room by
    shifting the data in place (``fallocate(FALLOC_FL_INSERT_RANGE)`` on Linux ext4/XFS) or, where
    that is unavailable, by one copy into a fresh file.
    """

    def __init__(self, path: str | os.PathLike[str], spill_bytes: int | None = None, background_bytes: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file: BinaryIO | None = open(self._partial, "w+b")  # noqa: SIM115
        self._spill = SPILL_BYTES if spill_bytes is None else spill_bytes
        self._compact_below = self._spill  # a streamed bundle smaller than this is rewritten compactly at close
        self._buffer: list[bytes] | None = []  # None once data streams to the file
        self._data_start = 0  # file offset of the data buffer once streaming (8 + reservation)
        self._names: set[int] = set()  # hashes of the tensor names written: duplicates are refused
        self._entries = bytearray()  # the header's tensor entries as they will appear in it (~80 bytes a tensor)
        self._entry_bytes = 0  # running estimate of the tensor entries' share of the header
        self._offset = 0
        self._records: BinaryIO = tempfile.SpooledTemporaryFile(max_size=4 << 20, dir=self.path.parent)  # type: ignore[assignment]
        self._record_count = 0
        # streamed tensor bytes go to a writer thread (up to this many unwritten; 0: written here)
        self._background = background_bytes if writebehind.AVAILABLE else 0
        self._behind: writebehind.WriteBehind | None = None
        if self._background and spill_bytes is None:
            self._spill = min(self._spill, BACKGROUND_SPILL_BYTES)

    @property
    def bytes_written(self) -> int:
        return self._offset

    @property
    def records_written(self) -> int:
        return self._record_count

    def add_record(self, record: Record) -> None:
        """Append one record (spooled to a temporary file until :meth:`close`)."""
        self.add_records((record,))

    def add_records(self, records: Iterable[Record | bytes]) -> None:
        """Append records, in order (one spool write per 4096: a capture's exit writes all of its records);
        ``bytes`` is a record's line as ``Record.model_dump_json(exclude_none=True)`` writes it."""
        if self._file is None:
            raise BundleError("bundle writer is closed")
        lines: list[bytes] = []
        for record in records:  # what model_dump_json(exclude_none=True) calls, without its Python wrapper
            # (or that line already: hooks.observer writes its records as pydantic would)
            lines.append(record if type(record) is bytes else record.__pydantic_serializer__.to_json(record, exclude_none=True))
            if len(lines) == 4096:
                self._spool_lines(lines)
        self._spool_lines(lines)

    def _spool_lines(self, lines: list[bytes]) -> None:
        if lines:
            self._records.write(b"\n".join(lines) + b"\n")
            self._record_count += len(lines)
            lines.clear()

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> None:
        """Append one tensor's raw little-endian bytes under ``name``."""
        refused = self._add_views(((name, dtype, shape, data),))
        if refused:
            raise BundleError(refused[0][1])

    def add_views(self, items: Sequence[tuple[str, str, tuple[int, ...], Any]]) -> list[tuple[str, str]]:
        """Append tensors given as ``(name, dtype tag, shape, flat bytes)`` (any buffer), in order, as
        :meth:`add` does (the streamed ones queued for the writer thread under one lock); returns
        ``(name, why)`` for each one refused (a reserved or repeated name, a bad tag or size)."""
        return self._add_views(items)

    def _add_views(self, items: Iterable[tuple[str, str, tuple[int, ...], Any]],
                   ours: bool = False) -> list[tuple[str, str]]:
        """:meth:`add_views`; ``ours``: names under RESERVED_PREFIX are allowed (the records tensor)."""
        if self._file is None:
            raise BundleError("bundle writer is closed")
        refused: list[tuple[str, str]] = []
        queued: list[tuple[int, memoryview]] = []
        for name, dtype, shape, data in items:
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B") if view.nbytes else memoryview(b"")
            why = self._refusal(name, dtype, shape, view.nbytes, ours)
            if why:
                refused.append((name, why))
                continue
            size = view.nbytes
            self._entry(name, dtype, shape, size)
            self._entry_bytes += len(name) + 24 * len(shape) + 96
            begin = self._offset
            self._offset += size
            if self._buffer is not None and self._offset < self._spill:
                self._buffer.append(bytes(view))  # a copy: the caller may reuse its buffer
                continue
            if self._buffer is not None:
                self._start_streaming(queued)
            if self._behind is not None:
                queued.append((self._data_start + begin, view))
            else:
                self._write(begin, view)
        if queued:
            assert self._behind is not None
            self._behind.put_many(queued)
        return refused

    def _refusal(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, ours: bool) -> str:
        """Why a tensor cannot be added (empty when it can)."""
        if not ours and name.startswith(RESERVED_PREFIX):
            return f"tensor name {name!r}: names under {RESERVED_PREFIX!r} are opband's own"
        if hash(name) in self._names:
            return f"duplicate tensor name {name!r}"
        if dtype not in DTYPES:
            return f"unsupported dtype tag {dtype!r}"
        size = math.prod(shape) * DTYPES[dtype][1]
        if nbytes != size:
            return f"tensor {name!r}: {nbytes} bytes given, shape needs {size}"
        return ""

    def _write(self, begin: int, view: memoryview) -> None:
        """Stream bytes that belong at data offset ``begin``: written here (where the file position is
        ``begin`` already), or queued to the writer thread, which writes them at that offset (the caller
        keeps them unchanged until :meth:`drain`)."""
        assert self._file is not None
        if self._behind is not None:
            self._behind.put(self._data_start + begin, view)
        else:
            self._file.write(view)

    @property
    def background(self) -> bool:
        """Whether streamed bytes are written by a background thread (see :meth:`drain`)."""
        return self._background > 0

    @property
    def unwritten_bytes(self) -> int:
        """Tensor bytes added and still waiting for the writer thread (0 when writes are not in the background)."""
        return self._behind.unwritten if self._behind is not None else 0

    def drain(self) -> None:
        """Return once every tensor added so far is on disk: call it before anything may write into
        memory handed to :meth:`add` or :meth:`add_views` (background writes read it later); a no-op otherwise."""
        if self._behind is not None:
            self._behind.drain()

    def _entry(self, name: str, dtype: str, shape: tuple[int, ...], size: int) -> None:
        """Note a tensor's header entry (compact JSON, exactly as ``json.dumps`` of the header writes it)."""
        self._names.add(hash(name))  # below: what json.dumps(..., separators=(",", ":")) writes, without its machinery
        dims = ",".join([str(int(d)) for d in shape])
        self._entries += (f',{_json_str(name)}:{{"dtype":"{dtype}","shape":[{dims}],'
                          f'"data_offsets":[{self._offset},{self._offset + size}]}}').encode()

    def add_array(self, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        """Append a numpy array; ``dtype`` overrides the tag (for raw BF16/F8 payloads)."""
        tag = dtype or numpy_tag(array.dtype)
        self.add(name, tag, tuple(array.shape), np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)

    def _start_streaming(self, queued: list[tuple[int, memoryview]] | None = None) -> None:
        """From here on tensor bytes go to the file: the buffered ones first (with writes in the
        background, appended to ``queued`` for the thread when given, else put at once)."""
        assert self._file is not None and self._buffer is not None
        self._data_start = 8 + _reserve_for(self._entry_bytes)
        buffered, self._buffer = self._buffer, None
        if not self._background:
            self._file.seek(self._data_start)
            self._file.writelines(buffered)
            return
        self._behind = writebehind.WriteBehind(self._file.fileno(), self._background)  # writes at explicit offsets
        pieces, at = [], self._data_start
        for piece in buffered:
            view = memoryview(piece)
            pieces.append((at, view))
            at += view.nbytes
        if queued is not None:
            queued.extend(pieces)
        else:
            self._behind.put_many(pieces)

    def _add_records_tensor(self) -> None:
        """The spooled record lines, as the last tensor (streamed in pieces past ``spill_bytes``)."""
        spool = self._records
        size = spool.tell()
        spool.seek(0)
        if self._buffer is not None and self._offset + size < self._spill:
            self._add_views(((RECORDS_TENSOR, "U8", (size,), spool.read()),), ours=True)
            return
        self._entry(RECORDS_TENSOR, "U8", (size,), size)
        self._entry_bytes += len(RECORDS_TENSOR) + 120
        begin = self._offset
        self._offset += size
        if self._buffer is not None:
            self._start_streaming()
        while piece := spool.read(16 << 20):
            self._write(begin, memoryview(piece))
            begin += len(piece)

    def _manifest_json(self, manifest: Manifest) -> str:
        """The manifest without its records, which it names instead (format 2.0)."""
        head = manifest.model_copy(update={"format_version": FORMAT_VERSION, "records": []})
        text = head.model_dump_json(exclude_none=True, exclude={"records"})
        ref = RecordsRef(tensor=RECORDS_TENSOR, count=self._record_count).model_dump_json()
        return text[:-1] + ',"records":' + ref + "}"

    def close(self, manifest: Manifest) -> Path:
        """Write header + data to ``path`` atomically and return it (records: those added with
        :meth:`add_record`, then ``manifest.records``)."""
        if self._file is None:
            raise BundleError("bundle writer is closed")
        try:
            self.add_records(manifest.records)
            self._add_records_tensor()
        except BaseException:
            self.abort()  # the writer thread stopped, the partial file gone
            raise
        self._records.close()
        metadata = {_META_FORMAT: FORMAT_NAME, _META_MANIFEST: self._manifest_json(manifest)}
        raw = b'{"__metadata__":' + json.dumps(metadata, separators=(",", ":")).encode() + self._entries + b"}"
        self._entries = bytearray()
        raw += b" " * (-len(raw) % 8)  # align the data buffer to 8 bytes, as safetensors does
        out, self._file = self._file, None
        try:
            if self._behind is not None:
                behind, self._behind = self._behind, None
                behind.close()  # every streamed byte on disk before the header goes in front
            if self._buffer is None and self._offset < self._compact_below:  # streamed early, small after all
                out.flush()
                self._buffer = [_read_back(out.fileno(), self._data_start, self._offset)]
                out.seek(0)
                out.truncate()
            if self._buffer is not None:  # small bundle: one sequential write
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                out.writelines(self._buffer)
                self._buffer = None
            else:
                out = self._finish_streamed(out, raw)
            out.close()
        except BaseException:
            out.close()
            self._partial.unlink(missing_ok=True)
            raise
        os.replace(self._partial, self.path)
        return self.path

    def _finish_streamed(self, out: BinaryIO, raw: bytes) -> BinaryIO:
        """Put the header in front of the streamed data; returns the file that holds the bundle."""
        out.flush()
        reserved = self._data_start - 8
        if len(raw) > reserved:
            grow = (len(raw) - reserved + _BLOCK - 1) // _BLOCK * _BLOCK  # whole blocks: stays aligned
            if self._offset == 0 or not _insert_range(out.fileno(), self._data_start, grow):
                out = _relocate(out, self._partial, self._data_start, self._offset, reserved + grow)
            reserved += grow
        out.seek(0)
        out.write(struct.pack("<Q", reserved))
        out.write(raw + b" " * (reserved - len(raw)))
        return out

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._behind is not None:
            self._behind.stop()
            self._behind = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._records.close()
        self._buffer = None
        self._partial.unlink(missing_ok=True)

    def forget(self) -> None:
        """In a process forked while this writer was open: drop it without a byte reaching the
        parent's files (their descriptors here point at ``os.devnull`` from now on, so no flush or
        close of this copy can write into them; the parent's writer thread does not exist here)."""
        self._behind = None
        self._buffer = None
        files = [f for f in (self._file, getattr(self._records, "_file", None)) if f is not None]
        self._file = None
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for f in files:
                try:
                    os.dup2(null, f.fileno())
                except (OSError, ValueError, io.UnsupportedOperation):  # in memory, or closed: nothing shared
                    pass
        finally:
            os.close(null)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self.abort()


def _read_back(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes of a file from ``offset`` (what was just written there)."""
    parts, done = [], 0
    while done < size:
        part = os.pread(fd, size - done, offset + done)
        if not part:
            raise BundleError(f"reading back the bundle's data: {size - done} bytes missing at {offset + done}")
        parts.append(part)
        done += len(part)
    return b"".join(parts)  # one part: that part itself, not a copy


def _reserve_for(estimate: int) -> int:
    """Header reservation for an estimated header size: the 8-byte length and the header take
    twice the estimate (at least ``MIN_HEADER_RESERVE``), rounded up so that the data buffer (at
    ``8 + reservation``) starts on a block boundary."""
    want = max(2 * estimate + 8, MIN_HEADER_RESERVE, 1)
    return (want + _BLOCK - 1) // _BLOCK * _BLOCK - 8


_FALLOC_FL_INSERT_RANGE = 0x20


def _insert_range(fd: int, offset: int, length: int) -> bool:
    """Shift the bytes from ``offset`` on by ``length`` (block multiples) without copying them;
    False where the platform or file system cannot (then the caller copies)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        fallocate.restype = ctypes.c_int
        return fallocate(fd, _FALLOC_FL_INSERT_RANGE, offset, length) == 0
    except (OSError, AttributeError):
        return False


def _relocate(src: BinaryIO, path: Path, data_start: int, size: int, reserved: int) -> BinaryIO:
    """Copy ``size`` data bytes at ``data_start`` into a fresh file behind a ``reserved``-byte
    header region (in the kernel where the platform allows); the new file replaces ``path``."""
    tmp = path.with_name(path.name + ".grow")
    dst = open(tmp, "w+b")  # noqa: SIM115
    try:
        dst.seek(8 + reserved)
        _copy_range(src, dst, data_start, size)
    except BaseException:
        dst.close()
        tmp.unlink(missing_ok=True)
        raise
    src.close()
    os.replace(tmp, path)
    return dst


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, size: int) -> None:
    """Copy ``size`` bytes of ``src`` from ``start`` to ``dst`` at its current position."""
    dst.flush()
    at = dst.tell()
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - done, start + done, at + done)
            if n == 0:
                break
            done += n
    except (AttributeError, OSError):
        pass
    src.seek(start + done)
    dst.seek(at + done)
    while done < size:
        piece = src.read(min(size - done, 16 << 20))
        if not piece:
            raise BundleError("bundle data ended early while moving it")
        dst.write(piece)
        done += len(piece)


def numpy_tag(dtype: np.dtype) -> str:
    """safetensors tag for a numpy dtype."""
    for tag, (np_dtype, _) in DTYPES.items():
        if tag in ("BF16", "F8_E4M3", "F8_E5M2"):
            continue
        if np.dtype(dtype).newbyteorder("<") == np_dtype or np.dtype(dtype) == np_dtype:
            return tag
    raise BundleError(f"numpy dtype {dtype} has no bundle tag")


class Bundle:
    """A validated, read-only bundle. Tensors are memory-mapped on demand.

    Records: ``records`` (a list up to ``EAGER_RECORDS`` records, else a :class:`RecordList` that
    reads each one from the file), ``iter_records()`` (streams them), ``record(id)``,
    ``record_at(position)`` and ``index``, the compact columns comparisons align on.
    """

    def __init__(self, path: Path, manifest: Manifest, tensors: Mapping[str, TensorInfo], data_start: int,
                 index: RecordIndex | None = None, lines: tuple[int, np.ndarray] | None = None,
                 newer: bool = False) -> None:
        self.path = path
        self.manifest = manifest
        self.tensors = tensors
        self._data_start = data_start
        self._map: mmap.mmap | None = None  # the whole file, mapped once (not one memmap per tensor)
        self._lines = lines  # 2.0 lazy records: (file offset of the records tensor, line starts + end)
        self._newer = newer
        if index is None:
            index = RecordIndex()
            for r in manifest.records:
                index.add(r)
            index.freeze()
        self.index = index
        self._records_by_id: dict[str, Record] | None = (
            {r.id: r for r in manifest.records} if lines is None else None)
        if lines is not None:
            manifest.records = RecordList(index.count, self.record_at, self.iter_records)  # type: ignore[assignment]

    @classmethod
    @paused_gc()
    def open(cls, path: str | os.PathLike[str]) -> Bundle:
        """Open and validate ``path``; raises :class:`BundleError` saying what is wrong."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                metadata, tensors, data_start = read_header(f, size)
                _check_coverage(tensors, size - data_start)
                manifest, ref = _manifest_from_metadata(metadata)
                if ref is None:  # format 1.x: the records were in the manifest
                    _check_records(manifest.records, tensors, manifest.format_version)
                    return cls(path, manifest, tensors, data_start)
                info = _records_tensor(ref, tensors)
                newer = newer_minor(manifest.format_version)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    index, starts, eager = _scan_records(mm, data_start + info.begin, info.nbytes, ref.count,
                                                         tensors, manifest.format_version, newer)
        except OSError as e:
            raise BundleError(f"cannot read bundle {path}: {e.strerror}") from e
        if eager is not None:
            manifest.records = eager
            return cls(path, manifest, tensors, data_start, index)
        bundle = cls(path, manifest, tensors, data_start, index, (data_start + info.begin, starts), newer)
        bundle._check_unique_ids()
        return bundle

    @staticmethod
    def peek_records(path: str | os.PathLike[str]) -> tuple[int, int, int]:
        """``(records, record bytes, header bytes)`` of the bundle at ``path``, from its header alone
        (the records are not read or checked: a server refuses a bundle over its limits before
        validating it). Record bytes: the records tensor's size (0 in 1.x, whose header holds them)."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                metadata, tensors, data_start = read_header(f, size)
        except OSError as e:
            raise BundleError(f"cannot read bundle {path}: {e.strerror}") from e
        manifest, ref = _manifest_from_metadata(metadata)
        if ref is None:
            return len(manifest.records), 0, data_start - 8
        info = tensors.get(ref.tensor)
        return ref.count, info.nbytes if info is not None else 0, data_start - 8

    @property
    def records(self) -> list[Record]:
        """Every record: a list, or for a large bundle a sequence that reads them from the file."""
        return self.manifest.records

    def iter_records(self) -> Iterator[Record]:
        """The records in file order, one at a time (flat memory for any number of them)."""
        if self._lines is None:
            yield from self.manifest.records
            return
        for i in range(self.index.count):
            yield self.record_at(i)
            if i % 65536 == 65535:
                self.release_pages()

    def record_at(self, position: int) -> Record:
        """The record at ``position`` in file order."""
        if self._lines is None:
            return self.manifest.records[position]
        base, starts = self._lines
        begin, end = int(starts[position]), int(starts[position + 1]) - 1  # without its newline
        line = self._mapped()[base + begin : base + end]
        if self._newer:  # unknown fields of a newer minor version are dropped, as when it was opened
            return parse_record(line, True)
        return Record.model_validate_json(line)  # validated strictly when the bundle was opened

    def position(self, record_id: str) -> int | None:
        """Where the record with this id is (file order), or None."""
        for p in self.index.positions_of_hash(hash(record_id)):
            if self.record_at(int(p)).id == record_id:
                return int(p)
        return None

    def record(self, record_id: str) -> Record:
        """The record with this id; KeyError if there is none."""
        if self._records_by_id is not None:
            return self._records_by_id[record_id]
        p = self.position(record_id)
        if p is None:
            raise KeyError(record_id)
        return self.record_at(p)

    def _check_unique_ids(self) -> None:
        for group in self.index.duplicate_hash_positions():
            ids = [self.record_at(int(p)).id for p in group]
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            if repeated:
                raise BundleError(f"record {repeated[0]!r} appears twice in the bundle's records")

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident set (they stay in the page cache, and
        arrays read from the file stay valid): a long pass over a large bundle calls this now and then."""
        if self._map is not None:
            _release(self._map, 0, len(self._map) - len(self._map) % mmap.PAGESIZE)

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    def raw(self, name: str) -> np.ndarray:
        """The stored array (BF16/F8 as their raw integer words), memory-mapped, read-only."""
        return self._array(self.tensors[name])

    def stored(self, name: str) -> tuple[np.ndarray, str | None]:
        """``(array, dtype)`` for the metric kernels: BF16 as its raw words with ``dtype="BF16"``
        (read undecoded), FP8 decoded to float32, anything else as stored (``dtype=None``)."""
        info = self.tensors[name]
        if info.dtype == "BF16":
            return self._array(info), "BF16"
        return decode(self._array(info), info.dtype), None

    def buffer(self) -> np.ndarray:
        """The whole file as flat read-only bytes (memory-mapped): for kernels that read many tensors in
        one call, at the offsets :meth:`span` gives."""
        return np.frombuffer(self._mapped(), np.uint8)

    def span(self, name: str) -> tuple[int, int, str]:
        """``(offset in buffer(), byte count, stored dtype tag)`` of a tensor."""
        info = self.tensors[name]
        return self._data_start + info.begin, info.end - info.begin, info.dtype

    def values(self, name: str) -> np.ndarray:
        """The tensor as a numeric numpy array, decoding BF16/F8 to float32 (lazily mapped)."""
        info = self.tensors[name]
        return decode(self._array(info), info.dtype)

    def _array(self, info: TensorInfo) -> np.ndarray:
        np_dtype = DTYPES[info.dtype][0]
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype=np_dtype)
        count = info.nbytes // np_dtype.itemsize
        return np.frombuffer(self._mapped(), np_dtype, count, self._data_start + info.begin).reshape(info.shape)

    def record_values(self, record_id: str) -> np.ndarray | None:
        """A record's values in the record's own shape (its tensor may be stored under another
        shape of the same size, format 1.1), or None for a record without a tensor."""
        record = self.record(record_id)
        if record.tensor is None:
            return None
        return self.values(record.tensor).reshape(record.shape)

    def iter_chunks(self, name: str, chunk: int = 1 << 20) -> Iterator[np.ndarray]:
        """Flat chunks of the decoded tensor, ``chunk`` elements each."""
        flat = self.raw(name).reshape(-1)
        tag = self.tensors[name].dtype
        for start in range(0, flat.shape[0], chunk):
            yield decode(flat[start : start + chunk], tag)


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


#: Leading bytes of files that are not bundles, and what they are (checked before parsing).
_FOREIGN_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "a zip archive (torch.save/.pt files are zipped pickles)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x1f\x8b", "a gzip stream"),
    (b"BZh", "a bzip2 stream"),
    (b"\xfd7zXZ\x00", "an xz stream"),
    (b"\x28\xb5\x2f\xfd", "a zstd stream"),
    (b"\x93NUMPY", "a .npy array"),
    (b"\x89HDF", "an HDF5 file"),
)


def sniff_foreign(head: bytes) -> str | None:
    """What a file that is not a bundle looks like (pickle, archive …), from its first bytes."""
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_BYTES:
        return None  # shaped like a bundle: its own error message is the better one
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            return what
    if len(head) >= 2 and head[0] == 0x80 and head[1] <= 5:
        return "a Python pickle (bundles never hold pickles)"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "a tar archive"
    return None


def read_header(f: BinaryIO, size: int) -> tuple[Any, TensorTable, int]:
    """Read and strictly parse the safetensors header: (``__metadata__`` value or None, tensor table,
    data start offset). The tensor entries are checked here too (see :func:`_check_entry`).

    A file that fails a structural check and starts like a pickle, an archive or another known
    format is refused by that name (only then: a bundle whose header length begins with byte
    0x80 is a valid bundle, not a pickle).
    """
    head = f.read(512)
    f.seek(0)
    try:
        return _read_header(f, size)
    except BundleError:
        foreign = sniff_foreign(head)
        if foreign:
            raise BundleError(f"this file is {foreign}, not an opband bundle; write bundles with "
                              "`opband capture` or accuracy.BundleWriter") from None
        raise


def _read_header(f: BinaryIO, size: int) -> tuple[Any, TensorTable, int]:
    if size < 8:
        raise BundleError(f"file is {size} bytes; a bundle starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise BundleError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a bundle, or corrupt)")
    if n < 2:
        raise BundleError(f"header length {n} is too short for a JSON object")
    if 8 + n > size:
        raise BundleError(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = _header_json(f, n)
    if not raw.startswith(b"{"):
        raise BundleError("header does not start with '{': not a safetensors/opband bundle")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"bundle header is not valid UTF-8 (byte {e.start}): {e.reason}") from e
    del raw
    try:
        metadata, table = _parse_header(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"bundle header is not valid JSON: {e}") from e
    except RecursionError as e:
        raise BundleError("bundle header nests too deeply") from e
    return metadata, table, 8 + n


def _header_json(f: BinaryIO, n: int) -> bytes:
    """The ``n`` header bytes after the length word, without their trailing space padding. A streamed
    bundle reserves a megabyte or more: read through a mapping, the padding is compared in place
    (block by block against spaces), never copied, so a small bundle's open does not pay for it."""
    try:
        mm = mmap.mmap(f.fileno(), 8 + n, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # not a plain file: read it
        return _without_padding(f.read(n))
    with mm:
        last = mm.rfind(b"}", 8, 8 + n) + 1
        if last <= 0:
            return _without_padding(mm[8 : 8 + n])
        for at in range(last, 8 + n, len(_SPACES)):
            block = mm[at : min(at + len(_SPACES), 8 + n)]
            if block != _SPACES[: len(block)]:
                return _without_padding(mm[8 : 8 + n])  # not spaces after the last brace: as read, for the decoder to judge
        return mm[8:last]


_SPACES = b" " * (64 << 10)


def _without_padding(raw: bytes) -> bytes:
    """The header without its trailing space padding (a streamed bundle reserves a megabyte or more:
    one ``rfind`` and one compare find where it starts, ~100x faster than ``rstrip``)."""
    last = raw.rfind(b"}") + 1
    if last and raw.endswith(b" " * (len(raw) - last)):
        return raw[:last]
    return raw.rstrip(b" ")


_WS = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]
_MISSING = object()
_INT = r"(?:0|[1-9][0-9]{0,18})"
#: A tensor entry exactly as :class:`BundleWriter` writes it (compact, keys in its order, a name with
#: no escapes): read by one match instead of the JSON decoder. Anything else takes the decoder path,
#: which accepts any valid JSON spelling of the same entry (and says what is wrong with a bad one).
_CANONICAL_ENTRY = re.compile(
    rf'"([^"\\\x00-\x1f]{{1,4096}})":\{{"dtype":"([A-Z0-9_]{{1,8}})","shape":\[({_INT}(?:,{_INT})*)?\],'
    rf'"data_offsets":\[({_INT}),({_INT})\]\}}')


def _parse_header(text: str) -> tuple[Any, TensorTable]:
    """The header object, one entry at a time (the standard strict decoder for each value), so a
    million tensor entries never exist as Python dicts at once: each goes into the table as parsed."""
    decoder = json.JSONDecoder(object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant)
    match_entry = _CANONICAL_ENTRY.match
    scanstring = json.decoder.scanstring  # type: ignore[attr-defined]
    table = TensorTable()
    metadata: Any = _MISSING
    pos = _WS(text, 1).end()
    canonical_run: list[tuple[str, ...]] = []  # matched entries not yet in the table (added in order, in bulk)

    def expect(char: str, at: int) -> int:
        if at >= len(text) or text[at] != char:
            what = "Expecting property name enclosed in double quotes" if char == '"' else f"Expecting '{char}' delimiter"
            raise json.JSONDecodeError(what, text, at)
        return at + 1

    if pos < len(text) and text[pos] == "}":
        pos += 1
    else:
        while True:
            canonical = match_entry(text, pos)
            if canonical is not None and canonical[1] != "__metadata__":
                canonical_run.append(canonical.groups())
                pos = canonical.end()
                if len(canonical_run) == _CANONICAL_RUN:  # bounded: a million entries' strings would be ~350 MB
                    _add_canonical(table, canonical_run)
            else:
                _add_canonical(table, canonical_run)
                name, pos = scanstring(text, expect('"', pos), True)
                pos = _WS(text, expect(":", _WS(text, pos).end())).end()
                value, pos = decoder.raw_decode(text, pos)
                if name == "__metadata__":
                    if metadata is not _MISSING:
                        raise BundleError("duplicate JSON key '__metadata__': a bundle header must name each entry once")
                    metadata = value
                else:
                    table.add(name, *_check_entry(name, value))
            if text[pos : pos + 1] in _JSON_SPACE:
                pos = _WS(text, pos).end()
            if text[pos : pos + 1] == ",":
                pos += 1
                if text[pos : pos + 1] in _JSON_SPACE:
                    pos = _WS(text, pos).end()
                continue
            pos = expect("}", pos)
            break
    if _WS(text, pos).end() != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    _add_canonical(table, canonical_run)
    table.freeze()
    repeated = table.duplicate_name()
    if repeated is not None:
        raise BundleError(f"duplicate JSON key {repeated!r}: a bundle header must name each entry once")
    return (None if metadata is _MISSING else metadata), table


_JSON_SPACE = frozenset(" \t\n\r")  # what _WS skips (not "": a slice past the end is empty)
#: header entries matched and held before they are checked and added in bulk (:func:`_add_canonical`)
_CANONICAL_RUN = 4096


def _add_canonical(table: TensorTable, run: list[tuple[str, ...]]) -> None:
    """Check and add header entries matched by ``_CANONICAL_ENTRY`` (name, dtype, dims, begin, end), in
    order, then empty ``run``: :func:`_checked_entry`'s checks, done once per distinct dtype and shape
    and in one pass for the offsets; the first bad entry raises its own error."""
    if not run:
        return
    names, dtypes, dims, begin_text, end_text = zip(*run)
    run.clear()
    begins, ends = list(map(int, begin_text)), list(map(int, end_text))
    shape_of = {d: tuple(map(int, d.split(","))) if d else () for d in set(dims)}
    size_of = {(d, t): math.prod(shape_of[d]) * DTYPES[t][1] for d, t in set(zip(dims, dtypes))
               if t in DTYPES and len(shape_of[d]) <= 64}
    limit = 1 << 63
    for i, (d, t, b, e) in enumerate(zip(dims, dtypes, begins, ends, strict=True)):
        size = size_of.get((d, t))
        if size is None or e - b != size or e >= limit:
            _checked_entry(names[i], t, shape_of[d], b, e)  # raises, saying what is wrong
    table.extend(names, dtypes, [shape_of[d] for d in dims], begins, ends)


def _check_entry(name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor entry of the header, checked: (dtype, shape, begin, end)."""
    if not name or len(name) > 4096:
        raise BundleError(f"tensor name {name[:40]!r}: names must be 1 to 4096 characters")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BundleError(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):  # known names are checked with the rest in _checked_entry
        raise BundleError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BundleError(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise BundleError(f"tensor {name!r}: data_offsets must be two integers")
    return _checked_entry(name, dtype, tuple(shape), *offsets)


def _checked_entry(name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> tuple[str, tuple[int, ...], int, int]:
    """The checks of an entry whose fields have the right JSON types: known dtype, rank, offsets that fit its size."""
    if dtype not in DTYPES:
        raise BundleError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if len(shape) > 64:
        raise BundleError(f"tensor {name!r}: {len(shape)} dimensions (at most 64)")
    expected = math.prod(shape) * DTYPES[dtype][1]
    if begin < 0 or end < begin or end - begin != expected or end >= 1 << 63:
        raise BundleError(f"tensor {name!r}: data_offsets {[begin, end]} do not match shape {list(shape)} x {dtype}")
    return dtype, shape, begin, end


def _check_coverage(table: TensorTable, buffer_size: int) -> None:
    """The tensors cover the data buffer exactly: in data order each starts where the last one ended."""
    begin, end = table.begin[table.order], table.end[table.order]
    starts = np.concatenate([np.zeros(1, np.int64), end[:-1]])
    bad = np.flatnonzero(begin != starts)
    if bad.size:
        i = int(bad[0])
        raise BundleError(f"tensor {table.name(int(table.order[i]))!r}: data starts at {begin[i]}, expected "
                          f"{starts[i]} (hole or overlap)")
    cursor = int(end[-1]) if len(end) else 0
    if cursor != buffer_size:
        raise BundleError(f"data buffer is {buffer_size} bytes but tensors cover {cursor} (truncated or trailing bytes)")


def _manifest_from_metadata(metadata: Any) -> tuple[Manifest, RecordsRef | None]:
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BundleError("no __metadata__ string map: this is a safetensors file but not an opband bundle")
    if metadata.get(_META_FORMAT) != FORMAT_NAME or _META_MANIFEST not in metadata:
        raise BundleError(f"__metadata__ lacks format={FORMAT_NAME!r} and {_META_MANIFEST!r}: not an opband bundle")
    return parse_manifest_head(metadata[_META_MANIFEST])


def _records_tensor(ref: RecordsRef, tensors: TensorTable) -> TensorInfo:
    """The records tensor a 2.0 manifest names (hidden from ``tensors``: it holds no values)."""
    if ref.tensor != RECORDS_TENSOR:
        raise BundleError(f"manifest names records tensor {ref.tensor!r}; format 2.0 keeps records in {RECORDS_TENSOR!r}")
    info = tensors.hide(RECORDS_TENSOR)
    if info is None:
        raise BundleError(f"the manifest's records tensor {RECORDS_TENSOR!r} is not in the file (truncated or not "
                          "written by opband)")
    if info.dtype != "U8" or len(info.shape) != 1:
        raise BundleError(f"records tensor {RECORDS_TENSOR!r} must be 1-D U8 (JSON lines), not {info.dtype} {list(info.shape)}")
    return info


#: The scan of a records tensor drops the pages it has read from its mapping every this many bytes
#: (they stay in the page cache): resident memory stays flat however large the records are.
_RELEASE_BYTES = 32 << 20


def _release(mm: mmap.mmap, offset: int, length: int) -> None:
    """Drop a page-aligned range of a read-only file mapping from this process's resident set."""
    if length > 0 and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED, offset, length)


def _scan_records(mm: Any, start: int, size: int, count: int, tensors: Mapping[str, TensorInfo], version: str,
                  newer: bool) -> tuple[RecordIndex, np.ndarray, list[Record] | None]:
    """Validate a 2.0 records tensor line by line: (index, line starts, the records when they are few).

    Every line is parsed strictly and checked against the tensors; only the compact index (and, up to
    ``EAGER_RECORDS``, the Record objects) is kept."""
    if 3 * count > size:  # a record line is at least 3 bytes ("{}" and its newline)
        raise BundleError(f"the manifest says {count} records but the records tensor holds {size} bytes")
    index = RecordIndex()
    starts = np.zeros(count + 1, dtype=np.int64)
    eager: list[Record] | None = [] if count <= EAGER_RECORDS else None
    seen: set[str] | None = set() if eager is not None else None
    same_shape = _same_shape_required(version)
    pos, end, i = start, start + size, 0
    released = start - start % mmap.PAGESIZE  # pages before this are dropped from the mapping as the scan passes
    while pos < end:
        if pos - released > _RELEASE_BYTES:
            upto = pos - pos % mmap.PAGESIZE
            _release(mm, released, upto - released)
            released = upto
        if i == count:
            raise BundleError(f"the records tensor holds more than the {count} records the manifest says")
        nl = mm.find(b"\n", pos, min(end, pos + MAX_RECORD_BYTES + 1))
        if nl < 0:
            if end - pos > MAX_RECORD_BYTES:
                raise BundleError(f"record {i} is longer than {MAX_RECORD_BYTES} bytes (the limit for one record line)")
            raise BundleError(f"record {i} does not end with a newline (records tensor truncated?)")
        r = parse_record(mm[pos:nl], newer, where=f"record {i}")
        _check_record(r, tensors, same_shape)
        if seen is not None:
            if r.id in seen:
                raise BundleError(f"record {r.id!r} appears twice in the bundle's records")
            seen.add(r.id)
        if eager is not None:
            eager.append(r)
        index.add(r)
        starts[i] = pos - start
        pos, i = nl + 1, i + 1
    if i != count:
        raise BundleError(f"the manifest says {count} records but the records tensor holds {i}")
    starts[count] = size
    return index.freeze(), starts, eager


def _same_shape_required(version: str) -> bool:
    """Format 1.0: a record's tensor has the record's shape (1.1 on allow an equal-size reshape)."""
    major, _, minor = version.partition(".")
    return major == "1" and minor.isdigit() and int(minor) < 1


def _check_records(records: Sequence[Record], tensors: Mapping[str, TensorInfo], version: str) -> None:
    seen: set[str] = set()
    same_shape = _same_shape_required(version)
    for record in records:
        if record.id in seen:
            raise BundleError(f"record {record.id!r} appears twice in the manifest")
        seen.add(record.id)
        _check_record(record, tensors, same_shape)


def _check_record(record: Record, tensors: Mapping[str, TensorInfo], same_shape: bool) -> None:
    """A record against the tensors it names."""
    name = record.tensor
    if name is not None:
        info = tensors.get(name)  # a TensorTable or a dict
        if info is None:
            raise BundleError(f"record {record.id!r} names tensor {name!r}, which the file does not hold")
        stored = list(info.shape)
        if stored != record.shape:
            if same_shape:
                raise BundleError(f"record {record.id!r}: shape {record.shape} differs from tensor {name!r} "
                                  f"{stored} (format 1.0 needs the same shape; 1.1 allows an equal-size reshape)")
            if math.prod(stored) != math.prod(record.shape):
                raise BundleError(f"record {record.id!r}: shape {record.shape} has {math.prod(record.shape)} elements, "
                                  f"tensor {name!r} has shape {stored} ({math.prod(stored)} elements)")
        want = RECORD_DTYPE_TAG.get(record.dtype, "F32" if record.dtype.startswith("q") else None)
        if want is not None and info.dtype != want:
            raise BundleError(f"record {record.id!r} is {record.dtype} but tensor {name!r} is stored as "
                              f"{info.dtype} (expected {want})")
    for name in record.input_tensors or []:
        if name is not None and name not in tensors:
            raise BundleError(f"record {record.id!r} names input tensor {name!r}, which the file does not hold")
