"""``opband import msprobe DUMP_DIR``: an msprobe (MindStudio Probe) PyTorch dump as a bundle.

msprobe writes ``step*/rank*|proc*/dump.json`` (``task`` tensor or statistics, ``level`` L0
modules, L1 APIs, or mix), tensor files in ``dump_tensor_data/`` and, at mix level,
``construct.json`` (each entry's parent module). Keys follow opband's own capture where the
structure says enough:

- L0 ``Module.model.layers.0.mlp.down_proj.Linear.forward.0`` ->
  ``model.layers.0.mlp.down_proj/forward#0`` (kind ``module``, as any opband capture);
- mix-level APIs -> ``<parent module>/<torch name>#<ordinal in that module>`` (kind ``api``, as
  ``opband capture --level api``): ``Functional.linear`` is ``torch.nn.functional.linear``,
  ``Tensor.__mul__`` is ``torch.Tensor.mul``;
- L1 APIs without a parent keep msprobe's names: ``msprobe/Functional.linear#3``.

Statistics dumps become summary records (min, max, mean, L2 norm), which compare on statistics.
Only forward entries are imported; backward ones are counted in ``skipped_ops``.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from hooks.options import CaptureOptions
from hooks.peers.safeload import PeerDumpError, load_tensor, read_json, tensor_file
from hooks.recorder import Recorder

_PREFIX = {"Functional": "torch.nn.functional.", "Torch": "torch.", "Tensor": "torch.Tensor.", "NPU": "torch_npu.",
           "Distributed": "torch.distributed.", "Aten": "aten."}
#: msprobe wraps Tensor dunders by name; torch's function mode (opband's api level) sees the method.
_DUNDER = {"__add__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_", "__mul__": "mul",
           "__imul__": "mul_", "__truediv__": "div", "__itruediv__": "div_", "__div__": "div", "__matmul__": "matmul",
           "__pow__": "pow", "__neg__": "neg", "__and__": "bitwise_and", "__or__": "bitwise_or", "__eq__": "eq",
           "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__mod__": "remainder"}


def find_dump_json(source: str | os.PathLike[str]) -> Path:
    """``dump.json`` itself, or the single one under a dump folder (else say which to pick)."""
    p = Path(source)
    if p.is_file():
        return p
    if not p.is_dir():
        raise PeerDumpError(f"{p} does not exist: give msprobe's dump_path (or a step*/proc*/ folder, or dump.json)")
    found: list[Path] = []
    for pattern in ("dump.json", "*/dump.json", "*/*/dump.json", "*/*/*/dump.json"):
        found = found or sorted(p.glob(pattern))
    if not found:
        raise PeerDumpError(f"no dump.json under {p}: is it msprobe's dump_path? (expected step*/proc*/dump.json)")
    if len(found) > 1:
        listing = ", ".join(str(f.parent.relative_to(p)) for f in found[:8])
        raise PeerDumpError(f"{p} holds {len(found)} dumps ({listing}{' ...' if len(found) > 8 else ''}); "
                            "import one step and rank at a time: pass its folder")
    return found[0]


def parse_module_name(name: str) -> tuple[str, str, str, int] | None:
    """``Module.<path>.<Class>.<forward|backward>.<n>`` -> (path, class, direction, n)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "Module" or parts[-2] not in ("forward", "backward") or not parts[-1].isdigit():
        return None
    return ".".join(parts[1:-3]), parts[-3], parts[-2], int(parts[-1])


def parse_api_name(name: str) -> tuple[str, str, str, int] | None:
    """``<Prefix>.<api>.<n>.<forward|backward>`` -> (prefix, api, direction, n)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-1] not in ("forward", "backward") or not parts[-2].isdigit():
        return None
    return parts[0], ".".join(parts[1:-2]), parts[-1], int(parts[-2])


def torch_name(prefix: str, api: str) -> str:
    """The name opband's api level records for an msprobe API (``Tensor.__mul__`` -> ``torch.Tensor.mul``)."""
    if prefix == "Aten":
        return "aten." + api.split(".")[0]
    return _PREFIX.get(prefix, prefix + ".") + _DUNDER.get(api, api)


def _tensor_entries(value: Any) -> list[dict[str, Any]]:
    """The tensor entries of an msprobe argument list/tree, in order."""
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            return [value]
        return [t for v in value.values() if isinstance(v, (dict, list)) for t in _tensor_entries(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensor_entries(v)]
    return []


def _dtype_name(entry: dict[str, Any]) -> str:
    return str(entry.get("dtype", "float32")).removeprefix("torch.")


def _stats(entry: dict[str, Any]) -> dict[str, Any]:
    shape = [int(d) for d in entry.get("shape") or []]

    def num(k: str) -> float | None:
        v = entry.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    lo, hi = num("Min"), num("Max")
    absmax = max(abs(lo), abs(hi)) if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi) else None
    return {"numel": math.prod(shape), "min": lo, "max": hi, "mean": num("Mean"), "l2": num("Norm"), "absmax": absmax}


def import_msprobe(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert one msprobe PyTorch dump (one step, one rank) into a bundle at ``out``."""
    dump_json = find_dump_json(source)
    dump = read_json(dump_json, "msprobe dump.json")
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
        raise PeerDumpError(f"{dump_json} has no 'data' table: not an msprobe dump.json")
    framework = dump.get("framework", "pytorch")
    if framework != "pytorch":
        raise PeerDumpError(f"{dump_json} is a {framework} dump; opband imports msprobe's PyTorch dumps")
    task, level = str(dump.get("task", "")), str(dump.get("level", ""))
    if task not in ("tensor", "statistics"):
        raise PeerDumpError(f"{dump_json}: task {task!r}; import a 'tensor' or 'statistics' dump")
    folder = dump_json.parent
    construct_path = folder / "construct.json"
    parents: dict[str, Any] = read_json(construct_path, "msprobe construct.json") if construct_path.is_file() else {}
    parents = parents if isinstance(parents, dict) else {}
    data_dir = folder / "dump_tensor_data"
    rec = Recorder(Path(out), CaptureOptions(level="api", mode="full" if task == "tensor" else "summary", progress=False))
    placement = place_apis(parents)
    for name, entry in dump["data"].items():
        if not isinstance(entry, dict):
            rec.diagnose(name, "entry is not an object; skipped")
            continue
        where = _place(name, placement)
        if where == "merged":
            continue
        if where is None:
            rec.skipped[name.split(".")[0] + " (unrecognised name)"] += 1
            continue
        if where == "backward":
            rec.skipped["(backward entries)"] += 1
            continue
        kind, module, op, ordinal = where
        key = f"{module}/{op}#{ordinal}"
        inputs = _tensor_entries(entry.get("input_args")) + _tensor_entries(entry.get("input_kwargs"))
        shapes = [[int(d) for d in t.get("shape") or []] for t in inputs]
        dtypes = [_dtype_name(t) for t in inputs]
        outs = _tensor_entries(entry.get("output"))
        if task == "statistics" and any(not _finite_stats(o) for o in outs):
            rec.diagnose(key, "msprobe's statistics of a tensor with NaN/Inf span every element, opband's the finite "
                              "ones: not comparable, left out; dump with task 'tensor' to compare this op")
            continue
        if task == "tensor" and outs and all(isinstance(o.get("data_name"), str) and o["data_name"] not in ("", "-1")
                                             for o in outs):  # a named file: read (or refused) as a tensor
            tensors = [load_tensor(tensor_file(data_dir, o["data_name"])) for o in outs]
            first = len(rec.log)
            rec.record(kind, module, op, key, ordinal, tensors)
            rec.log.amend(first, input_shapes=shapes, input_dtypes=dtypes)
        else:
            for i, o in enumerate(outs):
                rec.record_summary(kind, module, op, key, ordinal, i, shapes, dtypes,
                                   [int(d) for d in o.get("shape") or []], _dtype_name(o), _stats(o))
    run = {"variant": "fp32", "device": "unknown", "level": "module" if level == "L0" else "api",
           "mode": "full" if task == "tensor" else "summary",
           "imported_from": {"tool": "msprobe", "task": task, "level": level, "dump": str(dump_json)}}
    env = {"importer": "opband import msprobe", "msprobe_framework": framework}
    return rec.finish(run, env)


def place_apis(parents: dict[str, Any]) -> dict[str, tuple[str, str, str, int] | str]:
    """Mix level: each API entry's (kind, module, op, ordinal) in opband's api-level terms, from
    construct.json (every call in execution order, dumped or not, so ordinals match). ``scalar / t``
    reaches msprobe as ``Tensor.reciprocal`` then ``Tensor.__mul__`` (torch's ``__rtruediv__``
    body) and opband as one ``torch.Tensor.__rtruediv__``: the pair becomes that one record."""
    out: dict[str, tuple[str, str, str, int] | str] = {}
    ordinals: Counter[tuple[str, str]] = Counter()
    names = [n for n in parents if parse_api_name(n) is not None]
    for i, name in enumerate(names):
        prefix, api, direction, _n = parse_api_name(name)  # type: ignore[misc]
        if direction == "backward" or name in out:
            continue
        parent = parents.get(name)
        parent_mod = parse_module_name(parent) if isinstance(parent, str) else None
        module = parent_mod[0] if parent_mod else ""
        op = torch_name(prefix, api)
        nxt = names[i + 1] if i + 1 < len(names) else None
        if (prefix, api) == ("Tensor", "reciprocal") and nxt is not None and parents.get(nxt) == parent \
                and parse_api_name(nxt)[:2] == ("Tensor", "__mul__"):  # type: ignore[index]
            out[name] = "merged"
            name, op = nxt, "torch.Tensor.__rtruediv__"
        out[name] = ("aten" if prefix == "Aten" else "api", module, op, ordinals[(module, op)])
        ordinals[(module, op)] += 1
    return out


def _place(name: str, placement: dict[str, tuple[str, str, str, int] | str]) -> tuple[str, str, str, int] | str | None:
    """(kind, module, op, ordinal) of one dump entry; ``"backward"``; ``"merged"``; None for an unknown name."""
    mod = parse_module_name(name)
    if mod is not None:
        path, _cls, direction, n = mod
        return "backward" if direction == "backward" else ("module", path, "forward", n)
    api = parse_api_name(name)
    if api is None:
        return None
    prefix, api_name, direction, n = api
    if direction == "backward":
        return "backward"
    if name in placement:
        return placement[name]
    return "api", "msprobe", f"{prefix}.{api_name}", n


def _finite_stats(entry: dict[str, Any]) -> bool:
    return all(not isinstance(entry.get(k), float) or math.isfinite(entry[k]) for k in ("Max", "Min", "Mean", "Norm"))


__all__ = ["find_dump_json", "import_msprobe", "parse_api_name", "parse_module_name", "torch_name"]
