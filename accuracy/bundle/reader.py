"""Reading a bundle: :class:`Bundle` maps the file once, checks the records against the tensor table and
reads records and tensors on demand."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from accuracy.errors import BundleError
from accuracy.gcpause import paused_gc
from accuracy.manifest import Manifest, Record, newer_minor, parse_record
from accuracy.records import RecordIndex, RecordList
from accuracy.bundle.table import DTYPES, RECORD_DTYPE_TAG, TensorInfo, decode
from accuracy.bundle.header import read_header, _check_coverage, _manifest_from_metadata, _records_tensor


#: The longest record line a reader accepts (a real record is well under 4 KiB).
MAX_RECORD_BYTES = 1 << 20


#: Bundles with at most this many records keep them as Record objects once opened (``Bundle.records``
#: is a list, as in format 1.x); larger ones keep a compact index and read records from the file.
EAGER_RECORDS = 50_000


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
