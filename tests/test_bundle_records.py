"""Format 2.0 records: streamed writing, lazy reading, hostile record lines, and large-comparison paths
(compact alignment, streamed judging) giving the same verdicts as the small-bundle paths."""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy import bundle as B
from accuracy.align import align, align_bundles, align_by_key
from accuracy.bundle import Bundle, BundleWriter
from accuracy.errors import BundleError
from accuracy.manifest import Manifest, Record, Stats
from accuracy.records import RecordList

C = importlib.import_module("accuracy.compare")  # the module (``accuracy.compare`` is also the function)


def _rec(i: int, module: str = "m", **kw: object) -> Record:
    fields: dict[str, object] = {"key": f"{module}/aten.mul#{i}", "module": module, "op": "aten.mul", "ordinal": i,
                                 "index": i, "shape": [2], "dtype": "float32"}
    return Record(**{**fields, **kw})  # type: ignore[arg-type]


def _lines(records: list[dict[str, object]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


def _v2(path: Path, lines: bytes, count: int | None = None, version: str = "2.0",
        tensor: str = "__opband__/records", dtype: str = "U8", extra: dict[str, object] | None = None) -> Path:
    """A 2.0 bundle from parts: one F32 tensor ``a`` and the records tensor holding ``lines``."""
    manifest = {"format_version": version, **(extra or {}),
                "records": {"tensor": "__opband__/records", "count": lines.count(b"\n") if count is None else count}}
    header = {"__metadata__": {"format": "opband.bundle", "opband.manifest": json.dumps(manifest)},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              tensor: {"dtype": dtype, "shape": [len(lines)], "data_offsets": [8, 8 + len(lines)]}}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + struct.pack("<2f", 1.0, 2.0) + lines)
    return path


GOOD = {"key": "m/aten.mul#0", "module": "m", "op": "aten.mul", "index": 0, "shape": [2], "dtype": "float32",
        "tensor": "a"}


def test_streamed_records_come_first_then_the_manifests(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "s.bundle")
    w.add_array("a", np.array([1.0, 2.0], np.float32))
    w.add_record(_rec(0, tensor="a", stats=Stats(numel=2, min=float("nan"), max=float("inf"))))
    w.add_records([_rec(1), _rec(2)])
    assert w.records_written == 3
    b = Bundle.open(w.close(Manifest(records=[_rec(3)])))
    assert [r.index for r in b.records] == [0, 1, 2, 3] and isinstance(b.records, list)
    st = b.records[0].stats
    assert st is not None and np.isnan(st.min) and st.max == float("inf")  # type: ignore[arg-type]
    assert sorted(b.tensors) == ["a"] and Bundle.peek_records(b.path)[0] == 4


def test_writer_refuses_its_own_tensor_names(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "w.bundle")
    with pytest.raises(BundleError, match="opband's own"):
        w.add_array("__opband__/records", np.zeros(3, np.uint8))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_records_stream_to_disk_behind_large_tensors(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "big.bundle", spill_bytes=16)
    for i in range(50):
        w.add_array(f"t{i}", np.full(2, i, np.float32))
        w.add_record(_rec(i, tensor=f"t{i}"))
    b = Bundle.open(w.close(Manifest()))
    assert len(b.records) == 50 and b.record_values("m/aten.mul#49").tolist() == [49.0, 49.0]  # type: ignore[union-attr]


@pytest.fixture
def lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bundle large: records read from the file, never held."""
    monkeypatch.setattr(B.reader, "EAGER_RECORDS", 0)


def test_a_large_bundle_reads_records_from_the_file(tmp_path: Path, lazy: None) -> None:
    w = BundleWriter(tmp_path / "l.bundle")
    for i in range(5):
        w.add_array(f"t{i}", np.full(2, i, np.float32))
        w.add_record(_rec(i, module=f"m{i % 2}", tensor=f"t{i}"))
    b = Bundle.open(w.close(Manifest()))
    recs = b.records
    assert isinstance(recs, RecordList) and len(recs) == 5
    assert recs[-1].index == 4 and [r.index for r in recs[1:4]] == [1, 2, 3] and [r.index for r in recs] == [0, 1, 2, 3, 4]
    assert b.record("m1/aten.mul#3").index == 3 and b.position("m0/aten.mul#4") == 4 and b.position("nope") is None
    with pytest.raises(KeyError):
        b.record("nope")
    with pytest.raises(IndexError):
        recs[5]
    assert b.record_values("m1/aten.mul#3").tolist() == [3.0, 3.0]  # type: ignore[union-attr]
    assert list(b.index.index) == [0, 1, 2, 3, 4] and sorted(b.index.modules) == ["m0", "m1"]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("lines,count,words", [
    (_lines([GOOD]) + _lines([{**GOOD, "index": 1}]), None, "appears twice"),
    (_lines([GOOD]), 2, "says 2 records but the records tensor holds 1"),
    (_lines([GOOD, {**GOOD, "key": "m/aten.mul#1"}]), 1, "more than the 1 records"),
    (_lines([GOOD])[:-1], 1, "does not end with a newline"),
    (_lines([GOOD]) + b"\n", 2, "record 1 is not valid JSON"),
    (b'{"key":"m/a#0","key":"m/a#1","module":"m","op":"a","index":0,"shape":[2],"dtype":"float32"}\n', None,
     "duplicate JSON key 'key'"),
    (b'{"key":"m/a#0","module":"m","op":"a","index":0,"shape":[2],"dtype":"float32","stats":{"numel":2,"min":NaN}}\n',
     None, "JSON constant NaN"),
    (_lines([{**GOOD, "evil": 1}]), None, "record 0 field evil"),
    (_lines([{**GOOD, "tensor": "gone"}]), None, "names tensor 'gone', which the file does not hold"),
    (_lines([{**GOOD, "tensor": "__opband__/records"}]), None, "which the file does not hold"),
    (_lines([{**GOOD, "dtype": "bfloat16"}]), None, "stored as F32 (expected BF16)"),
    (_lines([[1, 2]]), None, "record 0 must be a JSON object"),
    (b"\xff\xfe\n", None, "not valid UTF-8"),
    (_lines([GOOD]), 10**12, "says 1000000000000 records but the records tensor holds"),
    (_lines([{**GOOD, "output": 2**40}]), None, "is out of range"),
    (_lines([{**GOOD, "index": 2**70}]), None, "is out of range"),
])
def test_hostile_record_lines_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eager: bool, lines: bytes,
                                          count: int | None, words: str) -> None:
    if not eager:
        monkeypatch.setattr(B.reader, "EAGER_RECORDS", 0)
    with pytest.raises(BundleError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Bundle.open(_v2(tmp_path / "h.bundle", lines, count))


def test_a_record_line_over_the_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(B.reader, "MAX_RECORD_BYTES", 64)
    with pytest.raises(BundleError, match="record 0 is longer than 64 bytes"):
        Bundle.open(_v2(tmp_path / "h.bundle", _lines([{**GOOD, "module": "m" * 100}])))


@pytest.mark.parametrize("kw,words", [
    ({"dtype": "I8"}, "must be 1-D U8"),
    ({"tensor": "records"}, "is not in the file"),
    ({"version": "3.0"}, "upgrade opband"),
    ({"extra": {"future": 1}}, "manifest field future"),
])
def test_a_broken_records_tensor_or_manifest_is_refused(tmp_path: Path, kw: dict[str, object], words: str) -> None:
    lines = kw.pop("lines", _lines([GOOD]))
    with pytest.raises(BundleError, match=words):
        Bundle.open(_v2(tmp_path / "h.bundle", lines, **kw))  # type: ignore[arg-type]


def test_a_2_0_manifest_must_name_its_records_not_list_them(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "opband.bundle",
                               "opband.manifest": json.dumps({"format_version": "2.0", "records": [GOOD]})}}
    head = json.dumps(header).encode()
    path = tmp_path / "l.bundle"
    path.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(BundleError, match="names its records tensor"):
        Bundle.open(path)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
def test_lines_written_otherwise_still_read_and_a_newer_minor_drops_unknown_fields(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    if not eager:
        monkeypatch.setattr(B.reader, "EAGER_RECORDS", 0)
    other = b'{ "tensor": "a", "dtype": "float32", "shape": [2], "index": 0, "op": "aten.mul", "module": "m",' \
            b' "key": "m/aten.mul#0", "stats": {"numel": 2, "min": "-Infinity"} }\n'
    b = Bundle.open(_v2(tmp_path / "o.bundle", other))
    assert b.records[0].stats.min == float("-inf") and b.record("m/aten.mul#0").tensor == "a"  # type: ignore[union-attr]
    newer = _lines([{**GOOD, "new_field": 3, "stats": {"numel": 2, "kurtosis": 1.0}}])
    b = Bundle.open(_v2(tmp_path / "n.bundle", newer, version="2.7", extra={"future": {"x": 1}}))
    assert b.records[0].stats is not None and b.record("m/aten.mul#0").stats.numel == 2  # type: ignore[union-attr]


# -- comparisons: the compact and streamed paths give the small-bundle verdicts --

def _pair(tmp_path: Path) -> tuple[Path, Path]:
    """A reference and a target over several modules: equal modules, a module whose implementation
    differs (sequence-aligned and unmatched ops), one module missing on each side, a failing op
    with ops downstream of it (a dataflow graph), and passes."""
    rng = np.random.default_rng(3)
    refw, tgtw = BundleWriter(tmp_path / "r.bundle"), BundleWriter(tmp_path / "t.bundle")
    index = 0

    def both(module: str, op: str, n: int, ref_only: bool = False, tgt_only: bool = False, noise: float = 0.0,
             inputs: list[str] | None = None, tgt_op: str | None = None, kind: str = "aten") -> str:
        nonlocal index
        x = rng.standard_normal(64).astype(np.float32)
        key = f"{module}/{op}#{n}"
        name = f"t{index}"
        if not tgt_only:
            refw.add_array(name, x)
            refw.add_record(Record(key=key, module=module, op=op, ordinal=n, index=index, shape=[64], dtype="float32",
                                   tensor=name, input_tensors=inputs, kind=kind))  # type: ignore[arg-type]
        if not ref_only:
            y = (x + noise * rng.standard_normal(64)).astype(np.float32)
            top = tgt_op or op
            tgtw.add_array(name, y)
            tgtw.add_record(Record(key=f"{module}/{top}#{n}", module=module, op=top, ordinal=n, index=index,
                                   shape=[64], dtype="float32", tensor=name, input_tensors=inputs,
                                   kind=kind))  # type: ignore[arg-type]
        index += 1
        return name

    for layer in range(6):
        mod = f"model.layers.{layer}"
        a = both(mod, "aten.mm", 0, noise=0.5 if layer == 2 else 0.0)
        b = both(mod, "aten.relu", 0, inputs=[a], noise=0.5 if layer == 2 else 0.0)
        both(mod, "aten.mul", 0, inputs=[b], noise=0.02 if layer == 4 else 0.0)
        both(mod, "forward", 0, kind="module", noise=0.5 if layer == 2 else 0.0)
    q = both("model.q", "aten.addmm", 0, tgt_op="quantized.linear_dynamic", noise=0.3)
    both("model.q", "aten.relu", 0, inputs=[q], noise=0.3)
    both("model.q", "aten.gelu", 0, ref_only=True)
    both("model.gone", "aten.mm", 0, ref_only=True)
    both("model.new", "aten.mm", 0, tgt_only=True)
    run = {"variant": "fp32"}
    return refw.close(Manifest(run=run)), tgtw.close(Manifest(run=run))


def _summary(rep: C.ComparisonReport) -> tuple[object, ...]:
    ops = sorted((o.id, o.verdict, o.inherited, o.reason, o.aligned_by) for o in rep.ops if o.verdict != "pass")
    first = rep.first_divergence.id if rep.first_divergence else None
    return rep.verdict, rep.counts, first, ops, sorted((u.record.id, u.side, u.reason) for u in rep.unmatched)


def test_streamed_comparison_gives_the_same_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, tgt = _pair(tmp_path)
    full = accuracy.compare(ref, tgt)
    assert full.first_divergence is not None and full.counts["fail"] and full.counts["pass"] and full.unmatched
    monkeypatch.setattr(B.reader, "EAGER_RECORDS", 0)
    monkeypatch.setattr(C, "KEEP_ALL_RESULTS", 0)
    monkeypatch.setattr(C, "JUDGE_BATCH", 5)
    passed: list[C.OpResult] = []
    streamed = accuracy.compare(ref, tgt, on_pass=passed.extend)
    assert _summary(streamed) == _summary(full)
    assert streamed.passes_not_listed == full.counts["pass"] == len(passed) and streamed.total_ops == len(full.ops)
    assert sorted(o.id for o in passed) == sorted(o.id for o in full.ops if o.verdict == "pass")
    assert any("counted, not listed" in n for n in streamed.notes)


@pytest.mark.parametrize("by_key", [False, True], ids=["align", "align_by_key"])
def test_alignment_on_the_index_matches_alignment_of_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             by_key: bool) -> None:
    monkeypatch.setattr(B.reader, "EAGER_RECORDS", 0)
    ref_path, tgt_path = _pair(tmp_path)
    ref, tgt = Bundle.open(ref_path), Bundle.open(tgt_path)
    pairs, unmatched = align_bundles(ref, np.arange(ref.index.count), tgt, np.arange(tgt.index.count), by_key=by_key)
    want_pairs, want_unmatched = (align_by_key if by_key else align)(list(ref.records), list(tgt.records))
    assert [(p.reference.id, p.target.id, p.how) for p in pairs] == \
        [(p.reference.id, p.target.id, p.how) for p in want_pairs]
    assert [(u.record.id, u.side, u.reason) for u in unmatched] == \
        [(u.record.id, u.side, u.reason) for u in want_unmatched]
    assert pairs[-1] == want_pairs[-1] and len(pairs[1:3]) == 2


def test_a_1_x_pair_compares_as_before(tmp_path: Path) -> None:
    from test_bundle_format import v1_bundle

    recs = [{"key": f"m/aten.mul#{i}", "module": "m", "op": "aten.mul", "ordinal": i, "index": i, "shape": [2],
             "dtype": "float32", "tensor": f"t{i}"} for i in range(3)]
    man = json.dumps({"format_version": "1.2", "run": {"variant": "fp32"}, "records": recs})
    ref = v1_bundle(tmp_path / "r.bundle", man, {f"t{i}": np.array([i, 1.0], np.float32) for i in range(3)})
    tgt = v1_bundle(tmp_path / "t.bundle", man, {f"t{i}": np.array([i, 1.0 + (i == 1)], np.float32) for i in range(3)})
    rep = accuracy.compare(ref, tgt)
    assert rep.verdict == "fail" and rep.first_divergence is not None and rep.first_divergence.id == "m/aten.mul#1"


# -- ingest --

def test_ingest_streams_records_and_refuses_too_many_before_reading_them(tmp_path: Path, lazy: None) -> None:
    from api.errors import TooLarge
    from api.store.ingest import IngestLimits, inspect_bundle

    ref, _ = _pair(tmp_path)
    out = tmp_path / "records.jsonl"
    found = inspect_bundle(ref, out, IngestLimits())
    lines = out.read_text().splitlines()
    assert found.records == len(lines) == len(Bundle.open(ref).records)
    assert json.loads(lines[0])[:3] == ["model.layers.0/aten.mm#0", 0, "aten.mm"]
    broken = _v2(tmp_path / "b.bundle", b"not json\n" * 5)  # the count is refused before any line is read
    with pytest.raises(TooLarge, match="5 records; this server takes at most 4 per bundle"):
        inspect_bundle(broken, out, IngestLimits(max_records=4))
    many = _v2(tmp_path / "m.bundle", _lines([{**GOOD, "key": f"m/aten.mul#{i}", "ordinal": i} for i in range(40)]))
    count, record_bytes, header_bytes = Bundle.peek_records(many)
    assert count == 40 and record_bytes == len(_lines([{**GOOD, "key": f"m/aten.mul#{i}", "ordinal": i}
                                                       for i in range(40)]))
    with pytest.raises(TooLarge, match="manifest and records are .* bytes; this server reads at most 4,000 "
                                       r"\(OPBAND_MAX_MANIFEST_BYTES\)"):
        inspect_bundle(many, out, IngestLimits(max_manifest_bytes=4000))
    assert header_bytes < 4000 < header_bytes + record_bytes


@pytest.mark.sweep
def test_a_comparison_and_ingest_past_the_full_result_limit_stay_under_a_gigabyte(tmp_path: Path) -> None:
    """120k records (past ``KEEP_ALL_RESULTS``: lazy records, streamed judging), each step in a child."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from compare_records import ROOT, measure

    n = 120_000
    res = measure(n, 64, [ROOT], str(tmp_path), rounds=1)[0]
    compared, ingested = res["compare"], res["ingest"]
    assert not isinstance(compared, str) and not isinstance(ingested, str), res
    assert compared["verdict"] == "pass" and compared["ops"] == n and ingested["records"] == n
    assert compared["rss_peak"] - compared["rss_before"] < 1e9 and ingested["rss_peak"] - ingested["rss_before"] < 1e9
