"""Writing a bundle: :class:`BundleWriter` streams tensors after a reserved header region (or keeps a small
bundle in memory), then writes the header and manifest in place."""

from __future__ import annotations

import io
import json
import math
from json.encoder import encode_basestring_ascii as _json_str
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from accuracy import writebehind
from accuracy.errors import BundleError
from accuracy.manifest import FORMAT_NAME, FORMAT_VERSION, Manifest, Record, RecordsRef
from accuracy.bundle.table import DTYPES, _META_FORMAT, _META_MANIFEST, RECORDS_TENSOR, RESERVED_PREFIX, numpy_tag


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


class RecordLines:
    """Consecutive records as the JSON lines the bundle stores, in one buffer, each line ending in a
    newline (the compiled observer hands its records over this way: no object per record)."""

    __slots__ = ("data", "count")

    def __init__(self, data: bytes, count: int) -> None:
        self.data, self.count = data, count

    def lines(self) -> list[bytes]:
        """One bytes object per record."""
        return self.data.split(b"\n")[:-1] if self.count else []


class _RecordSpool:
    """The record lines added so far: the bytes objects themselves while they stay under ``SPILL_BYTES``
    (a capture's one buffer of lines is kept, not copied), a temporary file beside the bundle after."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._chunks: list[bytes] = []
        self.file: BinaryIO | None = None
        self.size = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.size += len(data)
        if self.file is None and self.size <= SPILL_BYTES:
            self._chunks.append(bytes(data))  # a bytes object stays as it is; anything mutable is copied
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile(dir=self._dir)  # noqa: SIM115
            self.file.writelines(self._chunks)
            self._chunks = []
        self.file.write(data)

    def in_memory(self) -> list[bytes] | None:
        """The lines' pieces, in order, unless they were spilled to the file."""
        return self._chunks if self.file is None else None

    def pieces(self, size: int = 16 << 20) -> Iterable[bytes]:
        """The lines in pieces of up to ``size`` bytes (the file read from its start)."""
        if self.file is None:
            yield from self._chunks
            return
        self.file.seek(0)
        while piece := self.file.read(size):
            yield piece

    def close(self) -> None:
        self._chunks = []
        if self.file is not None:
            self.file.close()


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
        self._records = _RecordSpool(self.path.parent)
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

    def add_records(self, records: Iterable[Record | bytes | RecordLines]) -> None:
        """Append records, in order (one spool write per 4096: a capture's exit writes all of its records);
        ``bytes`` is a record's line as ``Record.model_dump_json(exclude_none=True)`` writes it,
        :class:`RecordLines` several such lines."""
        if self._file is None:
            raise BundleError("bundle writer is closed")
        lines: list[bytes] = []
        for record in records:  # what model_dump_json(exclude_none=True) calls, without its Python wrapper
            # (or that line already: hooks.observer writes its records as pydantic would)
            kind = type(record)
            if kind is RecordLines:
                self._spool_lines(lines)
                self._records.write(record.data)  # type: ignore[union-attr]
                self._record_count += record.count  # type: ignore[union-attr]
                continue
            lines.append(record if kind is bytes else record.__pydantic_serializer__.to_json(record, exclude_none=True))  # type: ignore[union-attr]
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

    def add_views(self, items: Sequence[tuple[str, str, tuple[int, ...], Any]],
                  ready: Callable[[], object] | None = None) -> list[tuple[str, str]]:
        """Append tensors given as ``(name, dtype tag, shape, flat bytes)`` (any buffer), in order, as
        :meth:`add` does (the streamed ones queued for the writer thread under one lock); returns
        ``(name, why)`` for each one refused (a reserved or repeated name, a bad tag or size).
        ``ready`` returns once the buffers' bytes are final (device-to-host copies still arriving): the
        writer thread calls it before writing them, this call only when it must read them itself."""
        return self._add_views(items, ready=ready)

    def _add_views(self, items: Iterable[tuple[str, str, tuple[int, ...], Any]],
                   ours: bool = False, ready: Callable[[], object] | None = None) -> list[tuple[str, str]]:
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
            if ready is not None and (self._behind is None or (self._buffer is not None and self._offset + size < self._spill)):
                ready()  # read here, not by the writer thread: the bytes must have arrived (before any entry)
                ready = None
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
            self._behind.put_many(queued, ready)
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

    @property
    def waited_s(self) -> float:
        """Seconds callers waited for the writer thread to make room (its queue full)."""
        return self._behind.waited_s if self._behind is not None else 0.0

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
        """The spooled record lines, as the last tensor: kept in memory when the whole bundle stays under
        the size it would be compacted back to anyway (streaming them would only be read back), else
        streamed in pieces."""
        spool = self._records
        size = spool.size
        kept = spool.in_memory()
        if self._buffer is not None and kept is not None and self._offset + size < self._compact_below:
            self._entry(RECORDS_TENSOR, "U8", (size,), size)
            self._offset += size
            self._buffer.extend(kept)
            return
        self._entry(RECORDS_TENSOR, "U8", (size,), size)
        self._entry_bytes += len(RECORDS_TENSOR) + 120
        begin = self._offset
        self._offset += size
        if self._buffer is not None:
            self._start_streaming()
        for piece in spool.pieces():
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
        files = [f for f in (self._file, self._records.file) if f is not None]
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
