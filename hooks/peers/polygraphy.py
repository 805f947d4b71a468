"""``opband import polygraphy RESULTS.json``: Polygraphy run results (``polygraphy run --save-outputs``).

The JSON holds, per runner, a list of iterations mapping output names to arrays, each a base64
``.npy`` (read with ``allow_pickle=False``). One runner and iteration become one bundle; ONNX
output names such as ``/model/layers.0/mlp/down_proj/MatMul_output_0`` (``--onnx-outputs mark
all``) become ``model.layers.0.mlp.down_proj/onnx.MatMul#0``, so two runners' imports align per
layer; other names are kept: ``polygraphy/<name>#0``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hooks.options import CaptureOptions
from hooks.peers.safeload import PeerDumpError, read_json
from hooks.recorder import Recorder

_ONNX_NAME = re.compile(r"^/(?P<path>(?:[^/]+/)*)(?P<op>[A-Za-z]+)(?:_(?P<n>\d+))?_output_(?P<out>\d+)$")


def onnx_key(name: str) -> tuple[str, str, int, int]:
    """(module, op, ordinal, output) of an output name (see the module docstring)."""
    m = _ONNX_NAME.match(name)
    if m is None:
        return "polygraphy", name, 0, 0
    module = m["path"].strip("/").replace("/", ".")
    return module, f"onnx.{m['op']}", int(m["n"] or 0), int(m["out"])


def _array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, dict) and value.get("polygraphy_class") == "LazyArray":
        if "values" not in value:
            raise PeerDumpError(f"{where}: the array is stored outside the JSON (a LazyArray file); "
                                "save the run results with the arrays inline")
        value = value["values"]
    if not isinstance(value, dict) or value.get("polygraphy_class") != "ndarray" or not isinstance(value.get("array"), str):
        cls = value.get("polygraphy_class") if isinstance(value, dict) else type(value).__name__
        raise PeerDumpError(f"{where}: a {cls}, not a numpy array; only ndarray outputs are imported "
                            "(torch tensors in the JSON are torch.save pickles and are refused)")
    try:
        raw = base64.b64decode(value["array"].encode(), validate=True)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as e:
        raise PeerDumpError(f"{where}: not a plain base64 .npy array ({e}); object arrays and pickles are refused") from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise PeerDumpError(f"{where}: dtype {getattr(arr, 'dtype', '?')} is not a number type")
    return np.ascontiguousarray(arr)


def runners(results: Any, path: Path) -> list[tuple[str, list[Any]]]:
    if not isinstance(results, dict) or results.get("polygraphy_class") != "RunResults" or not isinstance(results.get("lst"), list):
        raise PeerDumpError(f"{path} is not Polygraphy RunResults JSON (save it with `polygraphy run --save-outputs`)")
    out = []
    for item in results["lst"]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise PeerDumpError(f"{path}: a runner entry is not [name, iterations]")
        out.append((item[0], item[1]))
    return out


def import_polygraphy(source: str | os.PathLike[str], out: str | os.PathLike[str], runner: str | None = None,
                      iteration: int = 0) -> Path:
    """Convert one runner's iteration of a Polygraphy RunResults JSON into a bundle at ``out``."""
    path = Path(source)
    found = runners(read_json(path, "Polygraphy run results"), path)
    names = [n for n, _ in found]
    if runner is None and len(found) != 1:
        raise PeerDumpError(f"{path} holds runners {names}: pick one with --runner")
    chosen = [(n, its) for n, its in found if runner is None or n == runner]
    if not chosen:
        raise PeerDumpError(f"{path} has no runner {runner!r}; it holds {names}")
    name, iterations = chosen[0]
    if not 0 <= iteration < len(iterations):
        raise PeerDumpError(f"runner {name} has {len(iterations)} iteration(s); --iteration {iteration} is out of range")
    it = iterations[iteration]
    if not isinstance(it, dict) or not isinstance(it.get("outputs"), dict):
        raise PeerDumpError(f"{path}: iteration {iteration} of {name} has no 'outputs' table")
    rec = Recorder(Path(out), CaptureOptions(level="api", mode="full", progress=False))
    for output_name, value in it["outputs"].items():
        module, op, ordinal, index = onnx_key(output_name)
        arr = _array(value, f"{path}: output {output_name!r}")
        key = f"{module}/{op}#{ordinal}"
        first = len(rec.log)
        rec.record("api", module, op, key, ordinal, torch.from_numpy(arr))
        rec.log.amend(first, output=index)
    target = re.sub(r"-N\d+-.*$", "", name)  # "onnxrt-runner-N0-12/01/26-15:06:56" -> "onnxrt-runner"
    run = {"variant": "fp32", "device": target, "level": "api", "mode": "full", "target": target,
           "imported_from": {"tool": "polygraphy", "runner": name, "iteration": iteration, "results": str(path)}}
    return rec.finish(run, {"importer": "opband import polygraphy"})
