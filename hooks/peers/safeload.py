"""Loading tensors from files other tools wrote, without running code from them."""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accuracy.errors import OpbandError

#: A tensor file name inside a dump's data folder: no folders, no '..', a known suffix.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}\.(pt|npy)$")
MAX_JSON_BYTES = 1 << 30


class PeerDumpError(OpbandError):
    """A peer's dump that cannot be imported; the message says which file and what to do."""


def read_json(path: Path, what: str) -> Any:
    """A JSON file (NaN/Infinity literals allowed, as Python's json writes them; duplicate keys refused)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise PeerDumpError(f"cannot read {what} {path}: {e.strerror}") from e
    if size > MAX_JSON_BYTES:
        raise PeerDumpError(f"{what} {path} is {size / 1e9:.1f} GB; the importer reads at most 1 GB of JSON")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise PeerDumpError(f"{what} {path} repeats a key in one object; refusing an ambiguous file")
        return dict(items)

    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=pairs)
    except (ValueError, UnicodeDecodeError) as e:
        raise PeerDumpError(f"{what} {path} is not valid JSON: {e}") from e


def tensor_file(folder: Path, name: Any) -> Path:
    """The file ``name`` inside ``folder``, refusing paths, links and unknown suffixes."""
    if not isinstance(name, str) or not SAFE_NAME.match(name) or ".." in name:
        raise PeerDumpError(f"tensor file name {str(name)[:80]!r} is not a plain .pt/.npy file name; refusing it")
    path = folder / name
    if path.is_symlink():
        raise PeerDumpError(f"{path} is a symbolic link; the importer reads only regular files inside the dump")
    if not path.is_file():
        raise PeerDumpError(f"{path} is missing: the dump's data folder is incomplete (copy the whole dump)")
    return path


def load_tensor(path: Path) -> torch.Tensor:
    """A plain tensor from a ``torch.save`` zip (restricted unpickler) or a ``.npy`` (no pickles)."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise PeerDumpError(f"{path}: not a plain .npy array ({e}); object arrays and pickles are refused") from e
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
            raise PeerDumpError(f"{path}: dtype {getattr(arr, 'dtype', '?')} is not a number type")
        return torch.from_numpy(np.ascontiguousarray(arr))
    if not zipfile.is_zipfile(path):
        raise PeerDumpError(f"{path}: not a torch.save zip archive (a legacy pickle file?); it is refused because "
                            "reading it would run its pickle. Re-dump with a current msprobe/torch")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise PeerDumpError(f"{path}: refused by torch's restricted (weights_only) loader: {first}") from e
    if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided:
        raise PeerDumpError(f"{path}: holds a {type(obj).__name__}, not a plain tensor; refusing it")
    return obj.detach()
