"""Hostile bundle files the reader must refuse, each with the words its BundleError must contain.

``python tests/hostile_bundles/generate.py OUT_DIR`` writes them as ``OUT_DIR/<name>.bundle``;
``tests/test_bundle_hostile.py`` builds them in memory. Each case breaks one rule of
``docs/bundle-format.md`` and nothing else, so the error names that rule.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import struct
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT = "opband.bundle"


def manifest(records: list[dict[str, Any]] | None = None, version: str = "1.0") -> str:
    recs = records if records is not None else [
        {"key": "m/aten.mul#0", "module": "m", "op": "aten.mul", "index": 0, "shape": [2], "dtype": "float32",
         "tensor": "m/aten.mul#0"}
    ]
    return json.dumps({"format_version": version, "records": recs}, separators=(",", ":"))


def header_bytes(header: dict[str, Any] | str | bytes, pad: bool = True, compact: bool = False) -> bytes:
    """``compact``: JSON as BundleWriter spells it (no spaces), which the reader parses by its fast path."""
    text = json.dumps(header, separators=(",", ":") if compact else None) if isinstance(header, dict) else header
    raw = text if isinstance(text, bytes) else text.encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def bundle(tensors: dict[str, dict[str, Any]] | None = None, data: bytes | None = None,
           man: str | None = None, meta: dict[str, Any] | None = None, compact: bool = False) -> bytes:
    """A bundle from parts; defaults make a valid one-tensor bundle (two float32 values)."""
    tensors = tensors if tensors is not None else {"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    meta = meta if meta is not None else {"format": FORMAT, "opband.manifest": man if man is not None else manifest()}
    data = data if data is not None else struct.pack("<2f", 1.0, 2.0)
    return header_bytes({"__metadata__": meta, **tensors}, compact=compact) + data


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"weight": [1.0, 2.0]}))
    return buf.getvalue()


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        payload = bundle()
        info = tarfile.TarInfo("run.bundle")
        info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def _dup_key_header() -> bytes:
    t = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    meta = json.dumps({"format": FORMAT, "opband.manifest": manifest()})
    return header_bytes(f'{{"__metadata__":{meta},"m/aten.mul#0":{t},"m/aten.mul#0":{t}}}') + struct.pack("<2f", 1, 2)


def _dup_key_manifest() -> bytes:
    rec = '{"key":"m/aten.mul#0","module":"m","op":"aten.mul","index":0,"shape":[2],"dtype":"float32","tensor":"m/aten.mul#0"}'
    man = '{"format_version":"1.0","records":[' + rec.replace('"index":0', '"index":0,"index":5') + "]}"
    return bundle(man=man)


#: name -> (file bytes, a phrase the BundleError message must contain)
CASES: dict[str, Callable[[], tuple[bytes, str]]] = {
    "empty_file": lambda: (b"", "0 bytes"),
    "short_file": lambda: (b"\x08\x00\x00", "3 bytes"),
    "huge_header_length": lambda: (struct.pack("<Q", 2**63) + b"{}", "exceeds"),
    "header_past_end": lambda: (struct.pack("<Q", 4096) + b'{"__metadata__":{}}', "runs past the end"),
    "truncated_data": lambda: (bundle()[:-3], "truncated"),
    "trailing_bytes": lambda: (bundle() + b"\x00" * 8, "trailing"),
    "hole": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                            data=b"\x00" * 12), "hole or overlap"),
    "overlap": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                               data=b"\x00" * 12), "hole or overlap"),
    "bad_dtype": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}),
                          "unknown dtype"),
    "shape_offset_mismatch": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
                                      "do not match shape"),
    "negative_dim": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}),
                             "non-negative"),
    "huge_shape_overflow": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2**62, 2**62],
                                                                       "data_offsets": [0, 8]}}), "do not match shape"),
    # the same broken entries spelled as BundleWriter writes them (the reader's fast path checks them too)
    "bad_dtype_compact": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}},
                                         compact=True), "unknown dtype"),
    "shape_offset_mismatch_compact": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [3],
                                                                                 "data_offsets": [0, 8]}}, compact=True),
                                              "do not match"),
    "huge_shape_overflow_compact": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2**62, 2**62],
                                                                               "data_offsets": [0, 8]}}, compact=True),
                                            "do not match"),
    "too_many_dims_compact": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [1] * 65 + [2],
                                                                         "data_offsets": [0, 8]}}, compact=True),
                                      "at most 64"),
    "hole_compact": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                                    data=b"\x00" * 12, compact=True), "hole or overlap"),
    "float_offsets": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}),
                              "two integers"),
    "extra_entry_field": lambda: (bundle(tensors={"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8],
                                                                     "code": "import os"}}), "exactly dtype"),
    "non_utf8_header": lambda: (header_bytes(b'{"__metadata__":{"format":"\xff\xfe"}}') , "not valid UTF-8"),
    "not_json": lambda: (header_bytes(b'{"__metadata__": nope}'), "not valid JSON"),
    "header_is_list": lambda: (header_bytes(b"[1, 2, 3]"), "start with '{'"),
    "nan_literal": lambda: (header_bytes(b'{"__metadata__":{"format":"opband.bundle"},"x":NaN}'), "NaN"),
    "duplicate_keys_header": lambda: (_dup_key_header(), "duplicate JSON key"),
    "duplicate_keys_manifest": lambda: (_dup_key_manifest(), "duplicate JSON key"),
    "unknown_major_version": lambda: (bundle(man=manifest(version="3.0")), "not supported"),
    "garbage_version": lambda: (bundle(man=manifest(version="one")), "not supported"),
    "no_metadata": lambda: (header_bytes({"m/aten.mul#0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
                            + b"\x00" * 8, "not an opband bundle"),
    "wrong_format_name": lambda: (bundle(meta={"format": "pt", "opband.manifest": manifest()}), "not an opband bundle"),
    "manifest_not_json": lambda: (bundle(man="{records: []}"), "manifest is not valid JSON"),
    "manifest_unknown_field": lambda: (bundle(man='{"format_version":"1.0","records":[],"evil":1}'), "evil"),
    "missing_tensor": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul", "index": 0,
                                                     "shape": [2], "dtype": "float32", "tensor": "nope"}])),
                               "does not hold"),
    "missing_input_tensor": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul",
                                                           "index": 0, "shape": [2], "dtype": "float32",
                                                           "tensor": "m/aten.mul#0", "input_tensors": ["gone"]}])),
                                     "does not hold"),
    "record_shape_mismatch": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul",
                                                            "index": 0, "shape": [1, 2], "dtype": "float32",
                                                            "tensor": "m/aten.mul#0"}])), "format 1.0 needs the same shape"),
    "record_size_mismatch": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul",
                                                           "index": 0, "shape": [3], "dtype": "float32",
                                                           "tensor": "m/aten.mul#0"}], version="1.1")), "has 3 elements"),
    "record_dtype_mismatch": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul",
                                                            "index": 0, "shape": [2], "dtype": "int32",
                                                            "tensor": "m/aten.mul#0"}])), "stored as"),
    "duplicate_record": lambda: (bundle(man=manifest([{"key": "m/aten.mul#0", "module": "m", "op": "aten.mul", "index": i,
                                                       "shape": [2], "dtype": "float32"} for i in range(2)])),
                                 "appears twice"),
    "pickle": lambda: (pickle.dumps({"weight": [1.0, 2.0]}, protocol=4), "pickle"),
    "pickle_protocol2": lambda: (pickle.dumps([1, 2, 3], protocol=2), "pickle"),
    "zip_archive": lambda: (_zip(), "zip archive"),
    "tar_archive": lambda: (_tar(), "tar archive"),
    "gzip": lambda: (b"\x1f\x8b\x08\x00" + b"\x00" * 40, "gzip"),
    "npy": lambda: (b"\x93NUMPY\x01\x00" + b"\x00" * 40, ".npy"),
    "random_bytes": lambda: (random.Random(1234).randbytes(4096), "exceeds"),
    "zero_bytes_page": lambda: (b"\x00" * 4096, "too short"),
}


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in CASES.items():
        (folder / f"{name}.bundle").write_bytes(make()[0])
    print(f"wrote {len(CASES)} hostile bundles to {folder}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hostile-bundles")
