"""Digests of the bundles that fixed captures write: the demo decoder and zoo models, every level and mode.

A bundle holds a timestamp and a description of the machine that wrote it; :func:`bundle_digest`
hashes everything else byte for byte (the records' JSON lines, every tensor's bytes and the rest of
the manifest), so a change anywhere in how records or tensors are written changes the digest.
``python tests/format_golden.py`` prints the digests as ``tests/data/format_golden.json`` holds them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "format_golden.json"
RECORDS = "__opband__/records"
#: the parts of a manifest that say when and where a bundle was written, not what it recorded
_VOLATILE = ("created_at", "environment")


def _header(data: bytes) -> tuple[dict[str, Any], int]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), 8 + n


def bundle_digest(path: Path) -> str:
    """sha256 of a bundle's bytes with its manifest's time and machine description taken out."""
    data = path.read_bytes()
    header, start = _header(data)
    meta = header.get("__metadata__", {})
    manifest = json.loads(meta.get("opband.manifest", "{}"))
    for key in _VOLATILE:
        manifest.pop(key, None)
    run = manifest.get("run", {})
    for key in ("started_at", "wall_s", "duration_s", "host", "pid"):
        run.pop(key, None)
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in header.items() if k != "__metadata__"}, sort_keys=True).encode())
    h.update(json.dumps({k: v for k, v in meta.items() if k != "opband.manifest"}, sort_keys=True).encode())
    h.update(json.dumps(manifest, sort_keys=True).encode())
    h.update(data[start:])
    return h.hexdigest()


#: fields whose values follow from the tensors' values (counts of special values, content digests): the
#: weights of a randomly initialised model already differ between CPUs (torch's vectorised RNG kernels)
_VALUE_FIELDS = frozenset({"nan", "inf", "zeros", "nonfinite", "digest"})


def _skeleton(value: Any) -> Any:
    """``value`` with every number, and every field that depends on the tensors' values, replaced by its
    type: what a bundle holds whatever the arithmetic and the machine."""
    if isinstance(value, dict):
        return {k: type(v).__name__ if k in _VALUE_FIELDS else _skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v) for v in value]
    if isinstance(value, float):
        return "float"
    return value


def structure_digest(path: Path) -> str:
    """sha256 of a bundle's structure: tensor names, dtypes, shapes and offsets, the manifest's fields and
    every record line's fields in their order, with numbers that depend on the machine's arithmetic
    (statistics, fingerprints) and the tensors' values left out."""
    data = path.read_bytes()
    header, start = _header(data)
    meta = header.get("__metadata__", {})
    manifest = json.loads(meta.get("opband.manifest", "{}"))
    for key in _VOLATILE:
        manifest.pop(key, None)
    manifest.pop("run", None)
    h = hashlib.sha256()
    # the records tensor (the last one) is as long as its lines' shortest-digit floats: its size is a value
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if RECORDS in tensors:
        tensors[RECORDS] = {"dtype": tensors[RECORDS]["dtype"], "begin": tensors[RECORDS]["data_offsets"][0]}
    h.update(json.dumps(tensors, sort_keys=True).encode())
    h.update(json.dumps(_skeleton(manifest), sort_keys=True).encode())
    records = header.get(RECORDS)
    if records is not None:
        begin, end = records["data_offsets"]
        for line in data[start + begin:start + end].splitlines():
            h.update(json.dumps(_skeleton(json.loads(line))).encode())  # key order kept
    return h.hexdigest()


def machine_key() -> str:
    """What the full digests depend on besides opband: torch's build and the CPU the kernels compile for."""
    import llvmlite.binding
    return f"torch {torch.__version__} on {llvmlite.binding.get_host_cpu_name()}"


def _demo() -> tuple[torch.nn.Module, tuple[Any, ...] | dict[str, Any]]:
    from hooks.demo_model import DecoderConfig, build
    return build(DecoderConfig(dim=64, layers=2, hidden=96, seq=8, vocab=128))


def _zoo(name: str) -> Callable[[], tuple[torch.nn.Module, Any]]:
    def build() -> tuple[torch.nn.Module, Any]:
        sys.path.insert(0, str(Path(__file__).parent))
        import zoo
        entry = next(m for m in zoo.MODELS if m.name == name)
        return entry.build()
    return build


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    "demo": _demo, "llama": _zoo("llama"), "gpt2": _zoo("gpt2"), "t5": _zoo("t5"), "resnet": _zoo("resnet")}
#: (level, mode, observer): the module level, the aten level's dispatch mode and its compiled observer
SETTINGS = (("module", "full", True), ("aten", "summary", True), ("aten", "summary", False),
            ("aten", "full", True), ("aten", "full", False))


def capture_digests(workdir: Path, models: dict[str, Callable[[], Any]] = MODELS) -> dict[str, tuple[str, str]]:
    """``{"model/level/mode/engine": (full digest, structure digest)}`` for every model and setting,
    captured on one thread."""
    from hooks import capture
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, str] = {}
    try:
        for name, build in models.items():
            model, inputs = build()
            for level, mode, observer in SETTINGS:
                os.environ["OPBAND_OBSERVER"] = "1" if observer else "0"
                path = workdir / f"{name}-{level}-{mode}-{int(observer)}.bundle"
                with torch.no_grad(), capture(model, path, level=level, mode=mode, progress=False):
                    model(**inputs) if isinstance(inputs, dict) else model(*inputs)
                out[f"{name}/{level}/{mode}/{'observer' if observer else 'dispatch'}"] = (
                    bundle_digest(path), structure_digest(path))
    finally:
        os.environ.pop("OPBAND_OBSERVER", None)
        torch.set_num_threads(threads)
    return out


def golden_file(digests: dict[str, tuple[str, str]], machine: str, known: dict[str, Any] | None = None) -> dict[str, Any]:
    """The golden file's content with this machine's full digests added (or replaced)."""
    known = known or {"structure": {}, "full": {}}
    return {"structure": {k: v[1] for k, v in sorted(digests.items())},
            "full": {**known.get("full", {}), machine: {k: v[0] for k, v in sorted(digests.items())}}}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        found = capture_digests(Path(tmp))
    known = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None
    print(json.dumps(golden_file(found, machine_key(), known), indent=1, sort_keys=True))
