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

The package: :mod:`~accuracy.bundle.table` (tensor table, dtypes), :mod:`~accuracy.bundle.header`
(reading the header), :mod:`~accuracy.bundle.writer`, :mod:`~accuracy.bundle.reader`.
"""

from __future__ import annotations

from accuracy.bundle.table import (  # noqa: F401
    DTYPES, _TAG_NAMES, _TAG_CODES, RECORD_DTYPE_TAG, _META_FORMAT, _META_MANIFEST, RECORDS_TENSOR, RESERVED_PREFIX, DICT_TENSORS, TensorInfo, TensorTable, numpy_tag, decode, _fp8_table, _FP8_TABLES, _decode_fp8,
)
from accuracy.bundle.header import (  # noqa: F401
    MAX_HEADER_BYTES, _FOREIGN_MAGIC, sniff_foreign, read_header, _read_header, _header_json, _SPACES, _without_padding, _WS, _MISSING, _INT, _CANONICAL_ENTRY, _parse_header, _JSON_SPACE, _CANONICAL_RUN, _add_canonical, _check_entry, _checked_entry, _check_coverage, _manifest_from_metadata, _records_tensor,
)
from accuracy.bundle.writer import (  # noqa: F401
    SPILL_BYTES, BACKGROUND_SPILL_BYTES, MIN_HEADER_RESERVE, _BLOCK, BundleWriter, _read_back, _reserve_for, _FALLOC_FL_INSERT_RANGE, _insert_range, _relocate, _copy_range,
)
from accuracy.bundle.reader import (  # noqa: F401
    MAX_RECORD_BYTES, EAGER_RECORDS, Bundle, _RELEASE_BYTES, _release, _scan_records, _same_shape_required, _check_records, _check_record,
)
from accuracy.bundle import header, reader, table, writer  # noqa: F401, E402
from accuracy.manifest import Manifest  # noqa: F401, E402 - patched by tests as accuracy.bundle.Manifest
