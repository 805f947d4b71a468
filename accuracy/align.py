"""Pair the records of two bundles: by op key first, then by sequence inside each module.

Graphs differ between runs (an INT8 run calls ``quantized.linear_dynamic`` where fp32 calls
``aten.addmm``; a fused attention kernel replaces a softmax + two bmm). Module boundaries always
align, so records left over after the exact match are grouped by module path and paired by a
sequence alignment (``difflib``) of their op names, where shapes agree.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import dataclass

from accuracy.manifest import Record


@dataclass(frozen=True)
class Pair:
    """A reference record and the target record aligned with it."""

    reference: Record
    target: Record
    how: str  # "key" or "sequence"


@dataclass(frozen=True)
class Unmatched:
    """A record present on one side only, with the reason it found no partner."""

    record: Record
    side: str  # "reference" or "target"
    reason: str


def align(reference: list[Record], target: list[Record]) -> tuple[list[Pair], list[Unmatched]]:
    """Align two record lists; every record ends up in exactly one pair or one Unmatched."""
    by_id = {r.id: r for r in target}
    pairs: list[Pair] = []
    left_ref: list[Record] = []
    for ref in reference:
        tgt = by_id.pop(ref.id, None)
        if tgt is None:
            left_ref.append(ref)
        else:
            pairs.append(Pair(ref, tgt, "key"))
    left_tgt = [t for t in target if t.id in by_id]
    seq_pairs, unmatched = _align_by_module(left_ref, left_tgt)
    pairs.extend(seq_pairs)
    pairs.sort(key=lambda p: p.target.index)
    return pairs, unmatched


def _align_by_module(ref: list[Record], tgt: list[Record]) -> tuple[list[Pair], list[Unmatched]]:
    ref_groups: dict[str, list[Record]] = defaultdict(list)
    tgt_groups: dict[str, list[Record]] = defaultdict(list)
    for r in ref:
        ref_groups[r.module].append(r)
    for t in tgt:
        tgt_groups[t.module].append(t)
    pairs: list[Pair] = []
    unmatched: list[Unmatched] = []
    for module in sorted(set(ref_groups) | set(tgt_groups)):
        rs = sorted(ref_groups.get(module, []), key=lambda r: r.index)
        ts = sorted(tgt_groups.get(module, []), key=lambda r: r.index)
        if not ts:
            unmatched += [Unmatched(r, "reference", f"module {module!r} has no such op in the target") for r in rs]
            continue
        if not rs:
            unmatched += [Unmatched(t, "target", f"module {module!r} has no such op in the reference") for t in ts]
            continue
        matcher = difflib.SequenceMatcher(a=[r.op for r in rs], b=[t.op for t in ts], autojunk=False)
        used_r: set[int] = set()
        used_t: set[int] = set()
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag in ("equal", "replace"):
                for i, j in zip(range(i1, i2), range(j1, j2), strict=False):
                    if same_elements(rs[i], ts[j]) and rs[i].output == ts[j].output:
                        pairs.append(Pair(rs[i], ts[j], "sequence"))
                        used_r.add(i)
                        used_t.add(j)
        for i, r in enumerate(rs):
            if i not in used_r:
                unmatched.append(Unmatched(r, "reference", _reason(r, ts)))
        for j, t in enumerate(ts):
            if j not in used_t:
                unmatched.append(Unmatched(t, "target", _reason(t, rs)))
    return pairs, unmatched


def same_elements(a: Record, b: Record) -> bool:
    """Equal shapes, or equal element counts (a fused op may return ``2x32x128`` where ``mm`` gave ``64x128``)."""
    if a.shape == b.shape:
        return True
    na = nb = 1
    for d in a.shape:
        na *= d
    for d in b.shape:
        nb *= d
    return na == nb and na > 0


def _reason(record: Record, others: list[Record]) -> str:
    same_op = [o for o in others if o.op == record.op]
    if same_op and all(o.shape != record.shape for o in same_op):
        return f"{record.op} in {record.module!r} has shape {record.shape} on this side only"
    return f"no {record.op} at this position of module {record.module!r} on the other side"
