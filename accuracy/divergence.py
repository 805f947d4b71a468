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
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from accuracy.verdicts import Verdict

if TYPE_CHECKING:
    from accuracy.bundle import Bundle
    from accuracy.manifest import Record

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
    return r.verdict in (Verdict.FAIL, Verdict.WARN) and r.aligned_by != "none"


class InputsOf(Protocol):
    """The dataflow graph, read one op at a time: ``{result id: ids of the results that fed it}``."""

    def get(self, rid: str, default: Sequence[str] = ()) -> Sequence[str]: ...

    def __bool__(self) -> bool: ...


def mark_first_divergence(results: Sequence[Judged], local_everywhere: bool,
                          inputs_of: Mapping[str, Sequence[str]] | InputsOf | None = None,
                          measured_elsewhere: Callable[[str], bool] | None = None) -> Judged | None:
    """Set ``inherited`` on each result and return the first divergence (or None).

    ``results`` may leave out passing results of a large comparison: ``measured_elsewhere(id)`` then
    says whether an id absent from them was measured (and passed)."""
    bad = [r for r in results if _bad(r)]
    if not bad:
        return None
    by_id = {r.id: r for r in results}
    if local_everywhere:
        local = bad
    elif inputs_of:
        local = []
        for r in bad:
            ins = _measured_inputs(r.id, inputs_of, by_id, measured_elsewhere)
            bad_in = [by_id[i] for i in ins if i in by_id and _bad(by_id[i])]
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


def _measured_inputs(rid: str, inputs_of: Mapping[str, Sequence[str]] | InputsOf, by_id: Mapping[str, Judged],
                     measured_elsewhere: Callable[[str], bool] | None = None) -> list[str]:
    """The inputs of ``rid`` that were measured, following data through unmatched ops (the casts and
    copies a target adds: an fp32 op fed by a bf16 cast of a failing op inherits that failure)."""
    out: list[str] = []
    todo = [i for i in inputs_of.get(rid, ()) if i != rid]
    seen: set[str] = {rid}
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        if i not in by_id:
            if measured_elsewhere is not None and measured_elsewhere(i):
                seen.add(i)
                out.append(i)
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


class BundleDataflow:
    """:func:`dataflow` of a target bundle read one op at a time (flat memory for any size), keyed like
    the results: ``alias`` maps a sequence-aligned target id to its reference id."""

    def __init__(self, tgt: Bundle, alias: Mapping[str, str]) -> None:
        self.tgt, self.alias = tgt, alias
        self._unalias = {v: k for k, v in alias.items()}
        ti = tgt.index
        named = np.flatnonzero(ti.tensor_hash != 0)
        order = named[np.argsort(ti.index[named], kind="stable")]  # the first producer of a tensor wins
        self._keys, first = np.unique(ti.tensor_hash[order], return_index=True)
        self._producers = order[first]
        self._nonempty: bool | None = None

    def _producer(self, name: str) -> str | None:
        h = hash(name)
        k = int(np.searchsorted(self._keys, h))
        if k < len(self._keys) and self._keys[k] == h:
            rec = self.tgt.record_at(int(self._producers[k]))
            if rec.tensor == name:
                return rec.id
        return None

    def _inputs(self, t: Record) -> list[str]:
        ids = (self._producer(n) for n in t.input_tensors or () if n is not None)
        return [self.alias.get(i, i) for i in ids if i is not None]

    def _target_of(self, rid: str) -> Record | None:
        """The target record whose (aliased) id is ``rid`` and that names inputs; of two, the later one."""
        found = []
        tid = self._unalias.get(rid)
        if tid is not None:
            found.append(self.tgt.position(tid))
        if rid not in self.alias:
            found.append(self.tgt.position(rid))
        named = [(p, r) for p in found if p is not None and (r := self.tgt.record_at(p)).input_tensors]
        return max(named, key=lambda x: x[0])[1] if named else None

    def get(self, rid: str, default: Sequence[str] = ()) -> Sequence[str]:
        t = self._target_of(rid)
        return default if t is None else self._inputs(t)

    def __bool__(self) -> bool:
        """Whether any op was fed by another (else the execution-order rule applies)."""
        if self._nonempty is None:
            self._nonempty = any(self._inputs(self.tgt.record_at(int(p)))
                                 for p in np.flatnonzero(self.tgt.index.has_inputs))
        return self._nonempty
