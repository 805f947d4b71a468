"""Pair the records of two bundles: module by module, by op, output, shape and position.

Graphs differ between runs. A bf16 port adds casts; an INT8 run calls ``quantized.linear_dynamic``
where fp32 calls ``aten.addmm``; a port may compute attention through one fused SDPA op where the
reference runs bmm/softmax/bmm. Module boundaries always align, so records are grouped by step and
module path and paired inside each group (a record is never paired with one of another step: the
prefill and each decode step of a generation, or each step of a training loop, align on their own):

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from accuracy.bundle import Bundle
from accuracy.manifest import Record
from accuracy.records import RecordIndex

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
    implementation_differs: bool = False  # its module's implementation differs from here on


def align(reference: list[Record], target: list[Record]) -> tuple[list[Pair], list[Unmatched]]:
    """Align two record lists; every record ends up in exactly one pair or one Unmatched."""
    ref_groups: dict[tuple[int, str], list[Record]] = defaultdict(list)
    tgt_groups: dict[tuple[int, str], list[Record]] = defaultdict(list)
    for r in sorted(reference, key=lambda r: r.index):
        ref_groups[r.step, r.module].append(r)
    for t in sorted(target, key=lambda t: t.index):
        tgt_groups[t.step, t.module].append(t)
    pairs: list[Pair] = []
    unmatched: list[Unmatched] = []
    for group in sorted(set(ref_groups) | set(tgt_groups)):
        p, u = _align_module(group[1], ref_groups.get(group, []), tgt_groups.get(group, []))
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
            differs = id(rec) in after
            if differs:
                reason = (f"the implementation of module {module!r} differs from {core[start].op} on: its ops hold other "
                          "quantities, so the module's output is the comparison")
            else:
                reason = _reason(rec, others)
            unmatched.append(Unmatched(rec, side, reason, differs))
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


# -- alignment of whole bundles on their compact record index (flat memory for millions of records) --

HOWS = ("key", "sequence")


class PairList(Sequence[Pair]):
    """Aligned pairs as positions into two bundles' records (16 bytes a pair); each :class:`Pair` is
    read from the bundles when it is asked for."""

    def __init__(self, ref: Bundle, tgt: Bundle, ref_pos: np.ndarray, tgt_pos: np.ndarray, how: np.ndarray) -> None:
        self.ref, self.tgt = ref, tgt
        self.ref_pos, self.tgt_pos, self.how = ref_pos, tgt_pos, how

    def __len__(self) -> int:
        return int(self.ref_pos.shape[0])

    @overload
    def __getitem__(self, i: int) -> Pair: ...

    @overload
    def __getitem__(self, i: slice) -> list[Pair]: ...

    def __getitem__(self, i: int | slice) -> Pair | list[Pair]:
        if isinstance(i, slice):
            return [self._pair(k) for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("pair index out of range")
        return self._pair(i)

    def _pair(self, k: int) -> Pair:
        return Pair(self.ref.record_at(int(self.ref_pos[k])), self.tgt.record_at(int(self.tgt_pos[k])),
                    HOWS[self.how[k]])

    def __iter__(self) -> Iterator[Pair]:
        for k in range(len(self)):
            yield self._pair(k)

    def sequence_aligned(self) -> Iterator[Pair]:
        """The pairs aligned by position, not by key (their records' ids differ)."""
        for k in np.flatnonzero(self.how == 1):
            yield self._pair(int(k))


def _translate(src: list[object], dst: list[object]) -> np.ndarray:
    """For each code of ``src``'s values, the code of the same value in ``dst`` (-1 where absent)."""
    codes = {v: i for i, v in enumerate(dst)}
    return np.array([codes.get(v, -1) for v in src], dtype=np.int64).reshape(-1)


def align_bundles(ref: Bundle, ref_sel: np.ndarray, tgt: Bundle, tgt_sel: np.ndarray, by_key: bool = False,
                  ) -> tuple[PairList, list[Unmatched]]:
    """:func:`align` (or, ``by_key``, :func:`align_by_key`) of the records of two bundles at the
    positions ``ref_sel`` and ``tgt_sel`` (file order), on their compact index: modules whose op
    sequences are identical (the common case) pair without reading a record; only the others are
    read, one (step, module) group at a time. Same pairs, same order and same unmatched records as those functions."""
    if by_key:
        return _align_bundles_by_key(ref, ref_sel, tgt, tgt_sel)
    ri, ti = ref.index, tgt.index
    modules = sorted(set(ri.modules) | set(ti.modules))
    rank = {m: k for k, m in enumerate(modules)}
    r_mod = np.array([rank[m] for m in ri.modules], dtype=np.int64).reshape(-1)[ri.module[ref_sel]]
    t_mod = np.array([rank[m] for m in ti.modules], dtype=np.int64).reshape(-1)[ti.module[tgt_sel]]
    # the groups: (step, module) pairs of either side, in that order
    groups, inverse = np.unique(np.concatenate([np.stack([ri.step[ref_sel], r_mod], axis=1),
                                                np.stack([ti.step[tgt_sel], t_mod], axis=1)]).reshape(-1, 2),
                                axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    names = [modules[int(k)] for k in groups[:, 1]]
    r_rank, t_rank = inverse[:len(ref_sel)], inverse[len(ref_sel):]
    r_ord = ref_sel[np.lexsort((ri.index[ref_sel], r_rank))]  # by group, then execution order (stable)
    t_ord = tgt_sel[np.lexsort((ti.index[tgt_sel], t_rank))]
    r_rank, t_rank = np.sort(r_rank, kind="stable"), np.sort(t_rank, kind="stable")
    ms = np.arange(len(names))
    r0, r1 = np.searchsorted(r_rank, ms, "left"), np.searchsorted(r_rank, ms, "right")
    t0, t1 = np.searchsorted(t_rank, ms, "left"), np.searchsorted(t_rank, ms, "right")
    fast = _same_tokens(ri, r_ord, r0, r1, ti, t_ord, t0, t1)
    # the fast modules' pairs, in module order: the k-th record of a module on each side
    sizes = np.where(fast, r1 - r0, 0)
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    f_ref = r_ord[np.repeat(r0, sizes) + within] if sizes.sum() else np.zeros(0, np.int64)
    f_tgt = t_ord[np.repeat(t0, sizes) + within] if sizes.sum() else np.zeros(0, np.int64)
    parts_ref, parts_tgt, parts_how, parts_mod = [f_ref], [f_tgt], [(ri.id_hash[f_ref] != ti.id_hash[f_tgt]).astype(np.int8)], \
        [np.repeat(ms, sizes)]
    unmatched: list[Unmatched] = []
    for m in np.flatnonzero(~fast):
        rs_pos, ts_pos = r_ord[r0[m]:r1[m]], t_ord[t0[m]:t1[m]]
        rs = [ref.record_at(int(p)) for p in rs_pos]
        ts = [tgt.record_at(int(p)) for p in ts_pos]
        pairs, lost = _align_module(names[m], rs, ts)
        where = {id(x): int(p) for x, p in zip(rs, rs_pos, strict=True)} | {id(x): int(p) for x, p in zip(ts, ts_pos, strict=True)}
        parts_ref.append(np.array([where[id(p.reference)] for p in pairs], dtype=np.int64))
        parts_tgt.append(np.array([where[id(p.target)] for p in pairs], dtype=np.int64))
        parts_how.append(np.array([HOWS.index(p.how) for p in pairs], dtype=np.int8))
        parts_mod.append(np.full(len(pairs), m, dtype=np.int64))
        unmatched += lost
    p_ref, p_tgt = np.concatenate(parts_ref), np.concatenate(parts_tgt)
    p_how, p_mod = np.concatenate(parts_how), np.concatenate(parts_mod)
    seq = np.concatenate([np.arange(len(p)) for p in parts_ref])  # order inside each part
    part = np.concatenate([np.full(len(p), k) for k, p in enumerate(parts_ref)])
    order = np.lexsort((seq, part, p_mod))  # module order, then each module's own pair order
    order = order[np.argsort(ti.index[p_tgt[order]], kind="stable")]  # then by the target's execution order
    return PairList(ref, tgt, p_ref[order], p_tgt[order], p_how[order]), unmatched


def _same_tokens(ri: RecordIndex, r_ord: np.ndarray, r0: np.ndarray, r1: np.ndarray,
                 ti: RecordIndex, t_ord: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Per module: both sides non-empty with identical (op, output, shape) sequences."""
    n_r, n_t = r1 - r0, t1 - t0
    same_len = (n_r == n_t) & (n_r > 0)
    sizes = np.where(same_len, n_r, 0)
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    rp = r_ord[np.repeat(r0, sizes) + within]
    tp = t_ord[np.repeat(t0, sizes) + within]
    op_t = _translate(ti.ops, ri.ops)[ti.op[tp]]
    shape_t = _translate(ti.shapes, ri.shapes)[ti.shape[tp]]  # type: ignore[arg-type]
    equal = (ri.op[rp] == op_t) & (ri.shape[rp] == shape_t) & (ri.output[rp] == ti.output[tp])
    bad = np.bincount(np.repeat(np.arange(len(sizes)), sizes)[~equal], minlength=len(sizes))
    return same_len & (bad == 0)


def _align_bundles_by_key(ref: Bundle, ref_sel: np.ndarray, tgt: Bundle, tgt_sel: np.ndarray,
                          ) -> tuple[PairList, list[Unmatched]]:
    """:func:`align_by_key` on two bundles' index (ids matched by their 64-bit hashes)."""
    ri, ti = ref.index, tgt.index
    t_hash = ti.id_hash[tgt_sel]
    order = np.argsort(t_hash, kind="stable")
    keys = t_hash[order]
    r_hash = ri.id_hash[ref_sel]
    at = np.minimum(np.searchsorted(keys, r_hash), max(len(keys) - 1, 0))
    found = (keys[at] == r_hash) if len(keys) else np.zeros(len(ref_sel), bool)
    p_ref, p_tgt = ref_sel[found], tgt_sel[order[at[found]]]
    by_target = np.argsort(ti.index[p_tgt], kind="stable")
    taken = np.zeros(len(tgt_sel), bool)
    taken[order[at[found]]] = True
    unmatched = [Unmatched(ref.record_at(int(p)), "reference", "not replayed (see the replay's diagnostics)")
                 for p in ref_sel[~found]]
    unmatched += [Unmatched(tgt.record_at(int(p)), "target", "not in the reference") for p in tgt_sel[~taken]]
    return PairList(ref, tgt, p_ref[by_target], p_tgt[by_target], np.zeros(len(p_ref), np.int8)), unmatched
