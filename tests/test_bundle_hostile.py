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
