"""First divergence: the earliest op whose error is its own, not carried in by its inputs.

With a dataflow graph (records name their ``input_tensors`` and those tensors were produced by
earlier records) an out-of-band op is *local* when none of its inputs is out of band, or when its
error exceeds ``AMPLIFICATION`` times the largest error of its inputs (its own error dominates);
otherwise *inherited*. Without one, errors are assumed to flow forward in execution order: the
earliest out-of-band op (ATen records preferred, since they name the op) is the first divergence
and every later out-of-band op is inherited. In replay mode every op ran on the reference's
inputs, so every failure is local.

Unmatched target ops (the casts and copies a port adds) carry no verdict: the walk follows data
through them to the measured ops that fed them. ATen ops are preferred as the first divergence
since they name the op, but a failing module output none of whose own ops is out of band (its
inner ops ran another implementation and were left unpaired) is a candidate too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

#: An op whose error exceeds its worst input's error by more than this is local even so.
AMPLIFICATION = 64.0


class Judged(Protocol):
    verdict: str
    kind: str
    module: str
    index: int
    inherited: bool
    aligned_by: str

    @property
    def id(self) -> str: ...

    @property
    def error(self) -> float: ...


def _bad(r: Judged) -> bool:
    return r.verdict in ("fail", "warn") and r.aligned_by != "none"


def mark_first_divergence(results: Sequence[Judged], local_everywhere: bool,
                          inputs_of: Mapping[str, Sequence[str]] | None = None) -> Judged | None:
    """Set ``inherited`` on each result and return the first divergence (or None)."""
    bad = [r for r in results if _bad(r)]
    if not bad:
        return None
    by_id = {r.id: r for r in results}
    if local_everywhere:
        local = bad
    elif inputs_of:
        local = []
        for r in bad:
            ins = [by_id[i] for i in _measured_inputs(r.id, inputs_of, by_id)]
            bad_in = [i for i in ins if _bad(i)]
            worst_in = max((i.error for i in bad_in), default=0.0)
            r.inherited = bool(bad_in) and r.error <= AMPLIFICATION * worst_in
            if r.kind == "module" and not ins:  # a module's output carries its own ops' error, when they have one
                r.inherited = not _unexplained(r, bad)
            if not r.inherited:
                local.append(r)
        local = local or bad
    else:
        local = bad
    preferred = [r for r in local if r.kind != "module" or _unexplained(r, bad)] or local
    first = min(preferred, key=lambda r: r.index)
    if not local_everywhere and not inputs_of:
        for r in bad:
            r.inherited = r is not first and r.index > first.index
    return first


def _measured_inputs(rid: str, inputs_of: Mapping[str, Sequence[str]], by_id: Mapping[str, Judged]) -> list[str]:
    """The inputs of ``rid`` that were measured, following data through unmatched ops (the casts and
    copies a target adds: an fp32 op fed by a bf16 cast of a failing op inherits that failure)."""
    out: list[str] = []
    todo = [i for i in inputs_of.get(rid, ()) if i != rid]
    seen: set[str] = {rid}
    while todo:
        i = todo.pop()
        if i in seen or i not in by_id:
            continue
        seen.add(i)
        if by_id[i].aligned_by == "none":
            todo.extend(inputs_of.get(i, ()))
        else:
            out.append(i)
    return out


def _unexplained(module_result: Judged, bad: Sequence[Judged]) -> bool:
    """A failing module output none of whose own ops is out of band (they ran another implementation,
    or were not captured): the module boundary is where its error shows, so it is a candidate itself."""
    name = module_result.module
    return not any(r.kind != "module" and r.index < module_result.index
                   and (r.module == name or r.module.startswith(name + ".") or not name) for r in bad)


def dataflow(records: Sequence[object]) -> dict[str, list[str]]:
    """``{record id: [ids of the records that produced its inputs]}`` from ``input_tensors``.

    Empty when the bundle carries no input tensor names (the execution-order rule applies).
    """
    producer: dict[str, str] = {}
    for rec in sorted(records, key=lambda r: r.index):  # type: ignore[attr-defined]
        name = rec.tensor  # type: ignore[attr-defined]
        if name is not None and name not in producer:
            producer[name] = rec.id  # type: ignore[attr-defined]
    out: dict[str, list[str]] = {}
    for rec in records:
        names = rec.input_tensors  # type: ignore[attr-defined]
        if names:
            out[rec.id] = [producer[n] for n in names if n is not None and n in producer]  # type: ignore[attr-defined]
    return out if any(out.values()) else {}
