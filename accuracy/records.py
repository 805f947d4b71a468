"""A compact, columnar index of a bundle's records, for bundles too large to hold as Record objects.

A pydantic :class:`~accuracy.manifest.Record` costs ~3 KB; the index costs ~50 bytes a record: the
fields alignment needs (step, module, op, output, shape, kind, execution index) as numpy columns, with
strings and shapes interned, 64-bit hashes of each record's id and tensor name for lookups (every
hit is confirmed on the record itself), whether it names input tensors, and (kept by the bundle)
where its JSON line starts, so that any record can be read back from the file when it is needed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np

from accuracy.errors import BundleError
from accuracy.manifest import Record, RecordKind

KINDS: tuple[RecordKind, ...] = ("module", "aten", "api", "grad")
_KIND_CODES = {k: i for i, k in enumerate(KINDS)}


class _Interner:
    """Values to small integer codes and back."""

    def __init__(self) -> None:
        self.codes: dict[object, int] = {}
        self.values: list = []  # type: ignore[type-arg]

    def __call__(self, value: object) -> int:
        code = self.codes.get(value)
        if code is None:
            code = self.codes[value] = len(self.values)
            self.values.append(value)
        return code


class RecordIndex:
    """Columns of a bundle's records, in file order (build with :meth:`add`, then :meth:`freeze`)."""

    def __init__(self) -> None:
        self._modules, self._ops, self._shapes = _Interner(), _Interner(), _Interner()
        self._cols = {name: array(code) for name, code in (
            ("index", "q"), ("step", "q"), ("output", "i"), ("kind", "b"), ("module", "i"), ("op", "i"), ("shape", "i"),
            ("id_hash", "q"), ("tensor_hash", "q"), ("has_inputs", "b"))}
        self.count = 0

    def add(self, r: Record) -> None:
        if not (-(1 << 63) <= r.index < 1 << 63 and -(1 << 63) <= r.step < 1 << 63 and -(1 << 31) <= r.output < 1 << 31):
            raise BundleError(f"record {r.id[:200]!r}: index {r.index}, step {r.step} or output {r.output} is out of range")
        c = self._cols
        c["index"].append(r.index)
        c["step"].append(r.step)
        c["output"].append(r.output)
        c["kind"].append(_KIND_CODES[r.kind])
        c["module"].append(self._modules(r.module))
        c["op"].append(self._ops(r.op))
        c["shape"].append(self._shapes(tuple(r.shape)))
        c["id_hash"].append(hash(r.id))
        c["tensor_hash"].append(0 if r.tensor is None else hash(r.tensor))
        names = r.input_tensors
        c["has_inputs"].append(bool(names) and names.count(None) < len(names))
        self.count += 1

    def freeze(self) -> RecordIndex:
        """Turn the columns into numpy arrays (call once, after the last :meth:`add`)."""
        for name, col in self._cols.items():
            setattr(self, name, np.frombuffer(col, dtype=col.typecode).copy() if len(col) else
                    np.zeros(0, dtype=col.typecode))
        self._cols = {}
        self.modules: list[str] = self._modules.values
        self.ops: list[str] = self._ops.values
        self.shapes: list[tuple[int, ...]] = self._shapes.values
        self._by_hash: tuple[np.ndarray, np.ndarray] | None = None
        return self

    def positions_of_hash(self, h: int) -> np.ndarray:
        """Positions of the records whose id hashes to ``h`` (almost always one, or none)."""
        if self._by_hash is None:
            order = np.argsort(self.id_hash, kind="stable")
            self._by_hash = (self.id_hash[order], order)
        keys, order = self._by_hash
        lo, hi = np.searchsorted(keys, h, "left"), np.searchsorted(keys, h, "right")
        return order[lo:hi]

    def duplicate_hash_positions(self) -> Iterator[np.ndarray]:
        """Groups of positions sharing an id hash: candidates for a repeated record id (a real
        repeat, or, about once in 10^7 bundles of 10^6 records, two ids with the same 64-bit hash)."""
        if self.count < 2:
            return
        order = np.argsort(self.id_hash, kind="stable")
        keys = self.id_hash[order]
        for k in np.unique(keys[1:][keys[1:] == keys[:-1]]):
            lo, hi = np.searchsorted(keys, k, "left"), np.searchsorted(keys, k, "right")
            yield order[lo:hi]


class RecordList(Sequence[Record]):
    """``Bundle.records`` of a large bundle: a read-only sequence that reads each record from the file
    when it is asked for (iteration streams; nothing is cached)."""

    def __init__(self, count: int, read: Callable[[int], Record], scan: Callable[[], Iterator[Record]]) -> None:
        self._count, self._read, self._scan = count, read, scan

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> Record: ...

    @overload
    def __getitem__(self, i: slice) -> list[Record]: ...

    def __getitem__(self, i: int | slice) -> Record | list[Record]:
        if isinstance(i, slice):
            return [self._read(k) for k in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("record index out of range")
        return self._read(i)

    def __iter__(self) -> Iterator[Record]:
        return self._scan()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, RecordList)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __repr__(self) -> str:
        return f"<RecordList of {self._count} records>"
