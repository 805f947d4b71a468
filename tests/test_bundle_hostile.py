"""The reader refuses every hostile bundle with a BundleError naming the broken rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from accuracy.bundle import Bundle
from accuracy.errors import BundleError

sys.path.insert(0, str(Path(__file__).parent / "hostile_bundles"))
import generate  # noqa: E402


@pytest.mark.parametrize("name", sorted(generate.CASES))
def test_hostile_bundle_is_refused_with_a_reason(name: str, tmp_path: Path) -> None:
    data, phrase = generate.CASES[name]()
    path = tmp_path / f"{name}.bundle"
    path.write_bytes(data)
    with pytest.raises(BundleError) as info:
        Bundle.open(path)
    assert phrase.lower() in str(info.value).lower(), str(info.value)


def test_the_valid_base_bundle_opens(tmp_path: Path) -> None:
    """The mutations start from a valid file, so each case breaks exactly one rule."""
    path = tmp_path / "ok.bundle"
    path.write_bytes(generate.bundle())
    b = Bundle.open(path)
    assert [r.id for r in b.records] == ["m/aten.mul#0"]
    assert b.values("m/aten.mul#0").tolist() == [1.0, 2.0]


def test_missing_file_and_directory_are_bundle_errors(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="cannot read bundle"):
        Bundle.open(tmp_path / "nope.bundle")
    with pytest.raises(BundleError, match="cannot read bundle"):
        Bundle.open(tmp_path)


def test_header_length_starting_with_0x80_is_not_mistaken_for_a_pickle(tmp_path: Path) -> None:
    """A valid header of 128 + 256k bytes begins with byte 0x80 like a pickle; it must still open."""
    for target in (128, 384):
        run = {"pad": ""}
        for _ in range(2):
            meta = {"format": "opband.bundle", "opband.manifest": generate.manifest(records=[]), "pad": run["pad"]}
            raw = generate.header_bytes({"__metadata__": meta}, pad=False)
            run["pad"] += "x" * (target - (len(raw) - 8))
        data = generate.header_bytes({"__metadata__": {"format": "opband.bundle",
                                                       "opband.manifest": generate.manifest(records=[]),
                                                       "pad": run["pad"]}}, pad=False)
        assert data[0] == 0x80 and len(data) - 8 == target
        path = tmp_path / f"h{target}.bundle"
        path.write_bytes(data)
        assert Bundle.open(path).records == []


def test_generator_writes_every_case(tmp_path: Path) -> None:
    generate.main(str(tmp_path))
    assert len(list(tmp_path.glob("*.bundle"))) == len(generate.CASES)


def test_writer_headers_take_the_fast_path_and_free_form_headers_read_the_same(tmp_path: Path, monkeypatch) -> None:
    """BundleWriter's compact entries are read by one regex match each (the JSON decoder never sees
    them); the same header re-spelled (spaces, keys reordered, escapes) reads to the same table."""
    import json
    import struct

    import numpy as np

    from accuracy import bundle as bundle_mod
    from accuracy.bundle import BundleWriter
    from accuracy.manifest import Manifest

    path = tmp_path / "w.bundle"
    w = BundleWriter(path)
    w.add_array("a/aten.mm#0", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_array("scalar", np.float64(2.5).reshape(()))
    w.add_array("é \u2603 \"quoted\"", np.zeros(0, np.int8))  # escapes: the decoder path
    w.close(Manifest())
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])

    def entries(b: Bundle) -> list[tuple[str, str, tuple[int, ...], int, int]]:
        return sorted((i.name, i.dtype, i.shape, i.begin, i.end) for i in b.tensors.values())

    decoded: list[str] = []
    real_check = bundle_mod._check_entry
    monkeypatch.setattr(bundle_mod.header, "_check_entry", lambda name, entry: (decoded.append(name), real_check(name, entry))[1])
    fast = entries(Bundle.open(path))
    assert decoded == ['é ☃ "quoted"']  # only the name with escapes went through the decoder
    assert ("a/aten.mm#0", "F32", (2, 3), 0, 24) in fast and ("scalar", "F64", (), 24, 32) in fast

    respelled = {k: ({"data_offsets": v["data_offsets"], "shape": v["shape"], "dtype": v["dtype"]} if k != "__metadata__"
                     else v) for k, v in header.items()}
    text = json.dumps(respelled, indent=1, ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    path2 = tmp_path / "respelled.bundle"
    path2.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    decoded.clear()
    assert entries(Bundle.open(path2)) == fast
    assert len(decoded) == 4  # every entry, the records tensor's too


def test_runs_of_writer_entries_are_checked_in_bulk_and_in_order(tmp_path: Path) -> None:
    """Canonical entries are matched one by one and checked and added a run at a time: the table keeps
    the header's order across decoder-path entries, and a bad entry in the middle of a run is named."""
    import json
    import struct

    import numpy as np

    from accuracy.bundle import BundleWriter
    from accuracy.errors import BundleError
    from accuracy.manifest import Manifest

    path = tmp_path / "w.bundle"
    w = BundleWriter(path)
    for i in range(5):
        w.add_array(f"t{i}", np.full(2, i, np.float32))
    w.close(Manifest())
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])

    def rewrite(name: str, change: dict[str, object]) -> Path:
        parts = []
        for key, value in header.items():
            value = {**value, **change.get(key, {})} if key in change else value  # type: ignore[dict-item]
            spaced = key == "t2"  # one entry the JSON decoder reads
            parts.append(json.dumps(key) + ":" + json.dumps(value, separators=(", ", ": ") if spaced else (",", ":")))
        text = ("{" + ",".join(parts) + "}").encode()
        text += b" " * (-len(text) % 8)
        out = tmp_path / name
        out.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
        return out

    b = Bundle.open(rewrite("order.bundle", {}))
    assert [b.tensors.name(slot) for slot in range(5)] == ["t0", "t1", "t2", "t3", "t4"]  # header order
    assert [float(b.values(f"t{i}")[0]) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    begin = header["t3"]["data_offsets"][0]
    with pytest.raises(BundleError, match=f"tensor 't3': data_offsets \\[{begin}, {begin + 7}\\] do not match shape"):
        Bundle.open(rewrite("bad.bundle", {"t3": {"data_offsets": [begin, begin + 7]}}))


def test_a_long_run_of_writer_entries_is_added_in_bounded_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header of 60k writer-spelled entries: its matched entries are checked and added a bounded run at a
    time (a million held at once took ~350 MB), in order, and a bad entry past the first run is still named."""
    import json
    import tracemalloc

    import accuracy.bundle as bundle_module
    from accuracy.errors import BundleError

    n = 60_000
    entries = [json.dumps(f"tensor.{i:06d}") + ":" + json.dumps(
        {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * i, 16 * i + 16]}, separators=(",", ":")) for i in range(n)]
    text = "{" + ",".join(entries) + "}"
    held: list[int] = []
    add = bundle_module._add_canonical
    monkeypatch.setattr(bundle_module.header, "_add_canonical", lambda table, run: (held.append(len(run)), add(table, run)))
    tracemalloc.start()
    try:
        _, table = bundle_module._parse_header(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(held) == bundle_module._CANONICAL_RUN and sum(held) == n
    assert [table.name(s) for s in (0, 4095, 4096, n - 1)] == ["tensor.000000", "tensor.004095", "tensor.004096",
                                                                f"tensor.{n - 1:06d}"]
    assert table[f"tensor.{n - 1:06d}"].begin == 16 * (n - 1)
    assert peak < 16e6, f"parsing held {peak / 1e6:.1f} MB"  # the run held whole: ~25 MB
    entries[50_000] = entries[50_000].replace('"data_offsets":[800000,800016]', '"data_offsets":[800000,800017]')
    with pytest.raises(BundleError, match="tensor 'tensor.050000': data_offsets"):
        bundle_module._parse_header("{" + ",".join(entries) + "}")
