"""Reading a bundle's header: the 8-byte length, the JSON tensor table (a fast path for the canonical
entries opband writes, checked like any other), the manifest in its metadata, foreign formats named."""

from __future__ import annotations

import io
import json
import math
import mmap
import re
import struct
from typing import Any, BinaryIO

import numpy as np

from accuracy.errors import BundleError
from accuracy.manifest import FORMAT_NAME, Manifest, RecordsRef, parse_manifest_head
from accuracy.strictjson import _refuse_constant, _refuse_duplicates
from accuracy.bundle.table import DTYPES, _META_FORMAT, _META_MANIFEST, RECORDS_TENSOR, TensorInfo, TensorTable


#: Header size limit, as in the safetensors reference implementation.
MAX_HEADER_BYTES = 100_000_000


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
