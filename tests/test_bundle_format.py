"""Golden bytes of a tiny bundle, safetensors interoperability and the format's edge cases."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from accuracy.bundle import Bundle, BundleWriter
from accuracy.errors import BundleError
from accuracy.manifest import Manifest, Record

MANIFEST = (
    '{"format_version":"2.0","run":{"variant":"fp32"},"environment":{},"skipped_ops":{},"diagnostics":[],'
    '"records":{"tensor":"__opband__/records","count":1}}'
)
RECORD_LINE = (
    b'{"key":"m/aten.mul#0","output":0,"module":"m","op":"aten.mul","ordinal":0,"kind":"aten","index":0,'
    b'"input_shapes":[[2],null],"input_dtypes":[],"shape":[2],"dtype":"float32","tensor":"a","step":0}\n'
)


def v1_bundle(path: Path, manifest_json: str, tensors: dict[str, np.ndarray]) -> Path:
    """A format 1.x bundle (records inside the manifest), as opband 1.x wrote them."""
    header: dict[str, object] = {"__metadata__": {"format": "opband.bundle", "opband.manifest": manifest_json}}
    data = b""
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[str(array.dtype)], "shape": list(array.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def _tiny(path: Path) -> Path:
    w = BundleWriter(path)
    w.add_array("a", np.array([1.0, -2.5], np.float32))
    w.add_array("s", np.array(7, np.int8))  # 0-rank
    w.add_array("e", np.zeros((0, 3), np.float16))  # empty
    w.add("b", "BF16", (2,), np.array([0x3F80, 0xC020], np.uint16).data)  # 1.0, -2.5 in bfloat16
    manifest = Manifest(run={"variant": "fp32"}, records=[Record(
        key="m/aten.mul#0", module="m", op="aten.mul", index=0, shape=[2], dtype="float32", tensor="a",
        input_shapes=[[2], None])])
    return w.close(manifest)


def test_golden_bytes(tmp_path: Path) -> None:
    header = json.dumps({
        "__metadata__": {"format": "opband.bundle", "opband.manifest": MANIFEST},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "s": {"dtype": "I8", "shape": [], "data_offsets": [8, 9]},
        "e": {"dtype": "F16", "shape": [0, 3], "data_offsets": [9, 9]},
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [9, 13]},
        "__opband__/records": {"dtype": "U8", "shape": [len(RECORD_LINE)], "data_offsets": [13, 13 + len(RECORD_LINE)]},
    }, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    data = b"\x00\x00\x80\x3f" + b"\x00\x00\x20\xc0" + b"\x07" + b"\x80\x3f\x20\xc0" + RECORD_LINE
    expected = struct.pack("<Q", len(header)) + header + data
    got = _tiny(tmp_path / "tiny.bundle").read_bytes()
    assert got == expected
    assert len(got) == 744 and got[:8] == b"\x10\x02\x00\x00\x00\x00\x00\x00"
    assert (8 + len(header)) % 8 == 0  # the data buffer starts 8-byte aligned


def test_tiny_bundle_reads_back(tmp_path: Path) -> None:
    b = Bundle.open(_tiny(tmp_path / "tiny.bundle"))
    assert b.values("a").tolist() == [1.0, -2.5]
    assert b.values("s").shape == () and int(b.values("s")) == 7
    assert b.values("e").shape == (0, 3)
    assert b.values("b").tolist() == [1.0, -2.5]
    assert b.record("m/aten.mul#0").input_shapes == [[2], None]


def test_safetensors_reads_a_bundle(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    w = BundleWriter(tmp_path / "x.bundle")
    w.add_array("a", np.array([[1.0, np.nan], [np.inf, -0.0]], np.float32))
    w.add_array("i", np.arange(3, dtype=np.int64))
    path = w.close(Manifest())
    loaded = load_file(str(path))
    np.testing.assert_array_equal(loaded["a"], np.array([[1.0, np.nan], [np.inf, -0.0]], np.float32))
    assert loaded["i"].tolist() == [0, 1, 2]


def test_empty_bundle_is_valid(tmp_path: Path) -> None:
    path = BundleWriter(tmp_path / "empty.bundle").close(Manifest())
    assert Bundle.open(path).records == []


def test_fp8_decoding_matches_the_formats() -> None:
    from accuracy.bundle import decode

    e4m3 = decode(np.array([0x38, 0x7E, 0x7F, 0x01, 0xB8], np.uint8), "F8_E4M3")
    assert e4m3[0] == 1.0 and e4m3[1] == 448.0 and np.isnan(e4m3[2]) and e4m3[3] == 2.0**-9 and e4m3[4] == -1.0
    e5m2 = decode(np.array([0x3C, 0x7B, 0x7C, 0x7D, 0x01], np.uint8), "F8_E5M2")
    assert e5m2[0] == 1.0 and e5m2[1] == 57344.0 and e5m2[2] == np.inf and np.isnan(e5m2[3]) and e5m2[4] == 2.0**-16


def _with_manifest(tmp_path: Path, manifest_json: str) -> Path:
    header = json.dumps({"__metadata__": {"format": "opband.bundle", "opband.manifest": manifest_json}}).encode()
    path = tmp_path / "m.bundle"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_newer_minor_version_ignores_unknown_fields(tmp_path: Path) -> None:
    man = {"format_version": "1.7", "future": {"x": 1}, "records": [
        {"key": "m/f#0", "module": "m", "op": "f", "index": 0, "shape": [1], "dtype": "float32", "new_field": 3,
         "stats": {"numel": 1, "mean": 0.5, "kurtosis": 2.0}}]}
    b = Bundle.open(_with_manifest(tmp_path, json.dumps(man)))
    assert b.records[0].stats is not None and b.records[0].stats.mean == 0.5


def test_same_minor_version_refuses_unknown_fields(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="future"):
        Bundle.open(_with_manifest(tmp_path, json.dumps({"format_version": "1.0", "future": 1})))


def test_non_finite_statistics_round_trip(tmp_path: Path) -> None:
    from accuracy.manifest import Stats

    w = BundleWriter(tmp_path / "s.bundle")
    rec = Record(key="m/f#0", module="m", op="f", index=0, shape=[2], dtype="float32",
                 stats=Stats(numel=2, min=float("-inf"), max=float("nan"), nan=1, inf=1))
    b = Bundle.open(w.close(Manifest(records=[rec])))
    st = b.records[0].stats
    assert st is not None and st.min == float("-inf") and np.isnan(st.max)


def test_writer_refuses_wrong_sizes_and_duplicates(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "w.bundle")
    with pytest.raises(BundleError, match="bytes given"):
        w.add("a", "F32", (3,), b"\x00" * 8)
    w.add("a", "F32", (2,), b"\x00" * 8)
    with pytest.raises(BundleError, match="duplicate"):
        w.add("a", "F32", (2,), b"\x00" * 8)
    w.abort()
    assert not (tmp_path / "w.bundle").exists()


def _streamed(path: Path, records: int = 1) -> tuple[Path, Manifest]:
    """A bundle written with ``spill_bytes=0``: data streams behind a reserved header region."""
    w = BundleWriter(path, spill_bytes=0)
    w.add_array("a", np.array([1.0, -2.5], np.float32))
    w.add_array("i", np.arange(3, dtype=np.int64))
    recs = [Record(key=f"m{k}/aten.mul#0", module=f"m{k}", op="aten.mul", index=k, shape=[2], dtype="float32",
                   tensor="a") for k in range(records)]
    manifest = Manifest(records=recs)
    return w.close(manifest), manifest


def test_streamed_bundle_pads_the_header_into_its_reservation(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from accuracy import bundle as B

    path, manifest = _streamed(tmp_path / "s.bundle")
    got = path.read_bytes()
    (n,) = struct.unpack("<Q", got[:8])
    assert n == B.MIN_HEADER_RESERVE - 8 and (8 + n) % 4096 == 0  # the data starts block-aligned
    head = manifest.model_dump_json(exclude_none=True, exclude={"records"})
    head = head.replace('"1.2"', '"2.0"')[:-1] + ',"records":{"tensor":"__opband__/records","count":1}}'
    line = manifest.records[0].model_dump_json(exclude_none=True).encode() + b"\n"
    header = json.dumps({
        "__metadata__": {"format": "opband.bundle", "opband.manifest": head},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "i": {"dtype": "I64", "shape": [3], "data_offsets": [8, 32]},
        "__opband__/records": {"dtype": "U8", "shape": [len(line)], "data_offsets": [32, 32 + len(line)]},
    }, separators=(",", ":")).encode()
    data = b"\x00\x00\x80\x3f\x00\x00\x20\xc0" + np.arange(3, dtype="<i8").tobytes() + line
    assert got == struct.pack("<Q", n) + header + b" " * (n - len(header)) + data
    assert Bundle.open(path).values("i").tolist() == [0, 1, 2]
    loaded = load_file(str(path))  # safetensors' own reader accepts the space padding
    assert loaded["a"].tolist() == [1.0, -2.5] and loaded["i"].tolist() == [0, 1, 2]
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.grow"))


@pytest.mark.parametrize("tail", [b"x", b"}", b"\x00"])
def test_a_padded_header_with_anything_but_spaces_after_it_is_refused(tmp_path: Path, tail: bytes) -> None:
    """The header is read through a mapping and its padding compared in place (never copied): a byte
    other than a space anywhere in the padding, even the reservation's last, still fails the open."""
    path, _ = _streamed(tmp_path / "s.bundle")
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for at in (8 + n - 1, 8 + n - 70_000):  # in the padding's last block and in an earlier one
        bad = bytearray(raw)
        bad[at : at + 1] = tail
        (tmp_path / "bad.bundle").write_bytes(bytes(bad))
        with pytest.raises(BundleError, match="not valid JSON"):
            Bundle.open(tmp_path / "bad.bundle")
    assert Bundle.open(path).values("i").tolist() == [0, 1, 2]  # the untouched file still opens


@pytest.mark.parametrize("in_place", [True, False])
def test_header_that_outgrows_its_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    from safetensors.numpy import load_file

    from accuracy import bundle as B

    monkeypatch.setattr(B.writer, "MIN_HEADER_RESERVE", 0)
    if not in_place:  # file systems without FALLOC_FL_INSERT_RANGE: one copy into a fresh file
        monkeypatch.setattr(B.writer, "_insert_range", lambda *a: False)
    monkeypatch.setattr(B.Manifest, "model_dump_json",  # a manifest far larger than the reservation's estimate
                        lambda self, **kw: Manifest.model_validate(self).__class__.__pydantic_serializer__.to_json(
                            self.model_copy(update={"environment": {"notes": "x" * 20000}}), **kw).decode())
    path, _ = _streamed(tmp_path / "g.bundle", records=200)
    got = path.read_bytes()
    (n,) = struct.unpack("<Q", got[:8])
    assert n > 4088 and (8 + n) % 4096 == 0 and got[8 + n - 1 : 8 + n] == b" "
    b = Bundle.open(path)
    assert len(b.records) == 200 and b.values("a").tolist() == [1.0, -2.5]
    assert load_file(str(path))["i"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.bundle"]


def test_large_tensors_stream_and_read_back(tmp_path: Path) -> None:
    from accuracy import bundle as B

    big = np.arange(B.SPILL_BYTES // 4 + 1000, dtype=np.float32)
    w = BundleWriter(tmp_path / "big.bundle")
    w.add_array("small", np.array([3], np.int8))
    w.add_array("big", big)
    w.add_array("after", np.array([1.5], np.float32))
    b = Bundle.open(w.close(Manifest()))
    assert int(b.values("small")[0]) == 3 and b.values("after").tolist() == [1.5]
    np.testing.assert_array_equal(b.values("big"), big)
    assert b._data_start % 4096 == 0


def test_abort_after_streaming_leaves_nothing(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "x.bundle", spill_bytes=0)
    w.add_array("a", np.zeros(10, np.float32))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_record_may_name_a_tensor_of_another_shape_with_as_many_elements(tmp_path: Path) -> None:
    """Format 1.1: a module output that aliases an op output names the op's tensor."""
    w = BundleWriter(tmp_path / "r.bundle")
    w.add_array("m/aten.mm#0", np.arange(6, dtype=np.float32).reshape(3, 2))
    recs = [Record(key="m/aten.mm#0", module="m", op="aten.mm", index=0, shape=[3, 2], dtype="float32",
                   tensor="m/aten.mm#0"),
            Record(key="m/forward#0", module="m", op="forward", kind="module", index=1, shape=[1, 3, 2],
                   dtype="float32", tensor="m/aten.mm#0")]
    b = Bundle.open(w.close(Manifest(records=recs)))
    assert b.manifest.format_version == "2.0"
    out = b.record_values("m/forward#0")
    assert out is not None and out.shape == (1, 3, 2) and out.ravel().tolist() == [0, 1, 2, 3, 4, 5]
    assert b.record_values("m/aten.mm#0").shape == (3, 2)  # type: ignore[union-attr]


def test_a_version_1_0_bundle_still_reads(tmp_path: Path) -> None:
    man = json.dumps({"format_version": "1.0", "records": [
        {"key": "m/aten.mul#0", "module": "m", "op": "aten.mul", "index": 0, "shape": [2], "dtype": "float32",
         "tensor": "t"}]})
    path = v1_bundle(tmp_path / "old.bundle", man, {"t": np.array([1.0, 2.0], np.float32)})
    b = Bundle.open(path)
    assert b.manifest.format_version == "1.0" and b.record_values("m/aten.mul#0").tolist() == [1.0, 2.0]  # type: ignore[union-attr]
    reshaped = json.loads(man)
    reshaped["records"][0]["shape"] = [1, 2]  # an equal-size reshape: valid in 1.1, not in 1.0
    path = v1_bundle(tmp_path / "old2.bundle", json.dumps(reshaped), {"t": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(BundleError, match="format 1.0 needs the same shape"):
        Bundle.open(path)
    reshaped["format_version"] = "1.2"
    path = v1_bundle(tmp_path / "old3.bundle", json.dumps(reshaped), {"t": np.array([1.0, 2.0], np.float32)})
    assert Bundle.open(path).record_values("m/aten.mul#0").shape == (1, 2)  # type: ignore[union-attr]
