"""The capture format has one owner (``accuracy.capture_format``), and refactoring it changes no byte.

``tests/data/format_golden.json`` holds the digests of bundles that fixed captures wrote before the
format's definitions were gathered in one module (``tests/format_golden.py`` makes them): the
structure digest (names, field order, shapes, dtypes, offsets) must match on every machine; the full
digest (every byte but the timestamp and the machine description) on the machines it was taken on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from accuracy import capture_format as cf
from accuracy import fused
from accuracy.manifest import Record, Stats

import format_golden

ROOT = Path(__file__).resolve().parents[1]


def test_manifest_models_take_their_fields_from_the_format():
    assert tuple(Record.model_fields) == cf.RECORD_FIELDS
    assert tuple(Stats.model_fields) == (*cf.STAT_FIELDS, "sample")
    counts = {name for name in cf.STAT_FIELDS if Stats.model_fields[name].annotation in (int, "int")}
    assert counts == cf.STAT_COUNTS


def test_the_kernels_and_the_recorder_use_the_one_row_layout():
    import hooks.tensors as tensors
    assert fused.ROW_FIELDS == cf.STAT_FIELDS
    assert tensors.STAT_FIELDS is cf.STAT_FIELDS and tensors.SAMPLE_SIZE == cf.SAMPLE_SIZE
    row = fused.stats_row(np.arange(40, dtype=np.float32), np.arange(cf.SAMPLE_SIZE), "float32", cf.ROW_LENGTH, 1)
    assert len(row) == cf.ROW_LENGTH
    assert row[cf.STAT_FIELDS.index("max")] == 39.0 and row[cf.STAT_FIELDS.index("numel")] == 40


def test_one_dtype_registry():
    import torch
    import hooks.tensors as tensors
    from accuracy import bundle, metrics
    for d in cf.DTYPES.values():
        if d.tag is not None:
            assert tensors.dtype_tag(getattr(torch, d.name)) == d.tag
            assert bundle.RECORD_DTYPE_TAG[d.name] == d.tag
            assert torch.empty(0, dtype=getattr(torch, d.name)).element_size() == d.itemsize
    assert metrics.FLOAT_FORMATS is cf.FLOAT_FORMATS
    assert cf.FLOAT_FORMATS["bfloat16"] == (7, 2.0**-126) and cf.FLOAT_FORMATS["float16"] == (10, 2.0**-14)
    assert torch.finfo(torch.float16).tiny == cf.FLOAT_FORMATS["float16"][1]
    assert cf.KERNEL_DTYPES == ("float32", "float64", "bfloat16", "float16")  # the observer's row function order
    assert list(cf.BY_TAG) == ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8",
                               "BOOL"]  # tag codes: never reordered


def test_the_compiled_observer_is_built_for_this_row_layout():
    source = (ROOT / "hooks" / "native" / "observer.cpp").read_text()
    assert int(re.search(r"constexpr int kStatFields = (\d+);", source).group(1)) == len(cf.STAT_FIELDS)
    assert int(re.search(r"constexpr int kSample = (\d+);", source).group(1)) == cf.SAMPLE_SIZE


def test_bundles_are_byte_identical_to_the_golden_ones(tmp_path: Path):
    golden = json.loads(format_golden.GOLDEN.read_text())
    found = format_golden.capture_digests(tmp_path)
    assert {k: v[1] for k, v in found.items()} == golden["structure"]
    full = golden["full"].get(format_golden.machine_key())
    if full is None:
        pytest.xfail(f"no full digests recorded for {format_golden.machine_key()} (structure digests matched); "
                     "`python tests/format_golden.py` prints them")
    assert {k: v[0] for k, v in found.items()} == full


def test_the_observer_writes_record_fields_in_the_formats_order():
    source = (ROOT / "hooks" / "native" / "observer.cpp").read_text()
    body = source[source.index("py::tuple lines_of("):source.index("py::tuple drain_lines(")]
    written = re.findall(r'\\"([a-z_]+)\\":', body)
    fields = [f for f in written if f in cf.RECORD_FIELDS]
    assert fields == [f for f in cf.RECORD_FIELDS if f in fields]  # the order of the fields it writes
    assert {"key", "output", "module", "op", "ordinal", "kind", "index", "shape", "dtype", "stats", "step"} <= set(fields)
