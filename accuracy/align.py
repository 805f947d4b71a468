"""Pair the records of two bundles: module by module, by op, output, shape and position.

Graphs differ between runs. A bf16 port adds casts; an INT8 run calls ``quantized.linear_dynamic``
where fp32 calls ``aten.addmm``; a port may compute attention through one fused SDPA op where the
reference runs bmm/softmax/bmm. Module boundaries always align, so records are grouped by module
path and paired inside each module:

- identical op sequences (op, output index, shape) pair one for one;
- otherwise casts and copies (``TRANSPARENT`` ops, which move data without changing what it
  means) are set aside and the remaining sequences are aligned (``difflib``): equal runs pair,
  and so does a one-for-one substitution of ops with as many elements (addmm -> linear_dynamic).
  At the first insertion, deletion or uneven replacement the module's implementation differs:
  from there on its ops hold different quantities even where names match (SDPA's bmm holds scaled
  scores, the explicit bmm unscaled ones), so they stay unpaired and the module's output record
  (``module/forward#N``, always paired by key) is the comparison.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import dataclass

from accuracy.manifest import Record

#: Ops that move or convert data without changing what it means: inserting them does not move the
#: other ops' position in the module's dataflow.
TRANSPARENT = frozenset({
    "aten._to_copy", "aten.to", "aten.copy", "aten.copy_", "aten.clone", "aten.contiguous", "aten._unsafe_view",
    "aten.lift_fresh", "aten.lift_fresh_copy", "aten.detach", "aten.alias",
    # the same at the api level (``--level api``, msprobe's L1/mix): dtype casts, copies, layout changes
    "torch.Tensor.to", "torch.Tensor.float", "torch.Tensor.half", "torch.Tensor.bfloat16", "torch.Tensor.double",
    "torch.Tensor.type_as", "torch.Tensor.type", "torch.Tensor.contiguous", "torch.Tensor.clone", "torch.Tensor.detach",
})


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
    ref_groups: dict[str, list[Record]] = defaultdict(list)
    tgt_groups: dict[str, list[Record]] = defaultdict(list)
    for r in sorted(reference, key=lambda r: r.index):
        ref_groups[r.module].append(r)
    for t in sorted(target, key=lambda t: t.index):
        tgt_groups[t.module].append(t)
    pairs: list[Pair] = []
    unmatched: list[Unmatched] = []
    for module in sorted(set(ref_groups) | set(tgt_groups)):
        p, u = _align_module(module, ref_groups.get(module, []), tgt_groups.get(module, []))
        pairs += p
        unmatched += u
    pairs.sort(key=lambda p: p.target.index)
    return pairs, unmatched


def _token(r: Record) -> tuple[str, int, tuple[int, ...]]:
    return (r.op, r.output, tuple(r.shape))


def _pair(r: Record, t: Record) -> Pair:
    return Pair(r, t, "key" if r.id == t.id else "sequence")


def _align_module(module: str, rs: list[Record], ts: list[Record]) -> tuple[list[Pair], list[Unmatched]]:
    if not ts:
        return [], [Unmatched(r, "reference", f"module {module!r} has no such op in the target") for r in rs]
    if not rs:
        return [], [Unmatched(t, "target", f"module {module!r} has no such op in the reference") for t in ts]
    if [_token(r) for r in rs] == [_token(t) for t in ts]:  # the common case: same ops, same order
        return [_pair(r, t) for r, t in zip(rs, ts, strict=True)], []
    pairs: list[Pair] = []
    # the module's own output records: the module boundary, paired by key whatever happens inside
    mod_t = {t.id: t for t in ts if t.kind == "module"}
    for r in (r for r in rs if r.kind == "module"):
        t = mod_t.pop(r.id, None)
        if t is not None and same_elements(r, t):
            pairs.append(_pair(r, t))
    # casts and copies: paired by key where both sides have them alike, else left over
    side_t = {t.id: t for t in ts if t.kind != "module" and t.op in TRANSPARENT}
    for r in (r for r in rs if r.kind != "module" and r.op in TRANSPARENT):
        t = side_t.get(r.id)
        if t is not None and _token(t) == _token(r):
            pairs.append(_pair(r, side_t.pop(r.id)))
    core_r = [r for r in rs if r.kind != "module" and r.op not in TRANSPARENT]
    core_t = [t for t in ts if t.kind != "module" and t.op not in TRANSPARENT]
    changed_at: tuple[int, int] | None = None
    matcher = difflib.SequenceMatcher(a=[_token(r) for r in core_r], b=[_token(t) for t in core_t], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs += [_pair(core_r[i], core_t[j]) for i, j in zip(range(i1, i2), range(j1, j2), strict=True)]
        elif tag == "replace" and i2 - i1 == j2 - j1 and all(
                same_elements(core_r[i], core_t[j]) and core_r[i].output == core_t[j].output
                for i, j in zip(range(i1, i2), range(j1, j2), strict=True)):
            pairs += [Pair(core_r[i], core_t[j], "sequence") for i, j in zip(range(i1, i2), range(j1, j2), strict=True)]
        else:
            changed_at = (i1, j1)
            break
    paired = {id(p.reference) for p in pairs} | {id(p.target) for p in pairs}
    unmatched = []
    for side, records, others, start in (("reference", rs, ts, changed_at[0] if changed_at else None),
                                         ("target", ts, rs, changed_at[1] if changed_at else None)):
        core = core_r if side == "reference" else core_t
        after = {id(x) for x in core[start:]} if start is not None else set()
        for rec in records:
            if id(rec) in paired:
                continue
            if id(rec) in after:
                reason = (f"the implementation of module {module!r} differs from {core[start].op} on: its ops hold other "
                          "quantities, so the module's output is the comparison")
            else:
                reason = _reason(rec, others)
            unmatched.append(Unmatched(rec, side, reason))
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


def align_by_key(reference: list[Record], target: list[Record]) -> tuple[list[Pair], list[Unmatched]]:
    """Pair records with the same id only. For a replay (``hooks.replay``): each target op ran on
    the reference op's own inputs, so an op the replay could not run (a random one) leaves the
    others of its module comparable."""
    by_id = {t.id: t for t in target}
    pairs: list[Pair] = []
    unmatched: list[Unmatched] = []
    for r in reference:
        t = by_id.pop(r.id, None)
        if t is None:
            unmatched.append(Unmatched(r, "reference", "not replayed (see the replay's diagnostics)"))
        else:
            pairs.append(Pair(r, t, "key"))
    unmatched += [Unmatched(t, "target", "not in the reference") for t in by_id.values()]
    pairs.sort(key=lambda p: p.target.index)
    return pairs, unmatched
