"""The records of one capture, in execution order, kept in one place until the bundle is written.

Records arrive from two paths. The recorder makes a record's fields (:func:`record_fields`, in
:data:`~accuracy.capture_format.RECORD_FIELDS` order) and fills in its statistics at the end, from
a row of the capture's statistics batch. The compiled observer (``hooks.observer``) hands over its
records as the JSON lines the bundle stores, statistics included. :class:`RecordLog` keeps both in
their order and, at the end, gives the bundle writer one sequence of records.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, get_args

from accuracy.bundle.writer import RecordLines
from accuracy.capture_format import RECORD_FIELDS
from accuracy.manifest import Record, RecordKind, Stats, parse_record

_KINDS = frozenset(get_args(RecordKind))
_setattr = object.__setattr__
_MAX_KEY = Record.model_fields["key"].metadata[0].max_length


def record_fields(*values: Any) -> dict[str, Any]:
    """A record's fields from their values in :data:`~accuracy.capture_format.RECORD_FIELDS` order."""
    return dict(zip(RECORD_FIELDS, values, strict=True))


class _Reserved:
    """The place of records whose lines come later (a drain the observer deferred inside the forward)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


class RecordLog:
    """A capture's records in execution order: field dicts (statistics filled in by :meth:`fill_stats`)
    and the compiled observer's JSON lines, until :meth:`settle` makes them the bundle's records."""

    def __init__(self) -> None:
        self._items: list[dict[str, Any] | bytes | RecordLines | _Reserved] = []
        self._slots: list[int | None] = []  # per item: its statistics row, or None
        self._lines = 0
        self._count = 0  # records (a RecordLines item holds several)
        self._final: list[Record | bytes | RecordLines] | None = None

    def __len__(self) -> int:
        return self._count

    def add(self, fields: dict[str, Any], slot: int | None) -> None:
        """A record's fields (:func:`record_fields`); its statistics come from row ``slot`` at the end."""
        self._items.append(fields)
        self._slots.append(slot)
        self._count += 1

    def amend(self, since: int, **fields: Any) -> None:
        """Change ``fields`` of the records made from fields from position ``since`` on (an importer's
        names; importers add no lines)."""
        for r in self._items[since:]:
            if type(r) is dict:
                r.update(fields)

    def add_lines(self, lines: Sequence[bytes] | RecordLines) -> None:
        """Records as the JSON lines the bundle stores (statistics included), in order after the others:
        one bytes object each, or several in one :class:`~accuracy.bundle.writer.RecordLines`."""
        if type(lines) is RecordLines:
            self._items.append(lines)
            self._slots.append(None)
            n = lines.count
        else:
            self._items.extend(lines)  # type: ignore[arg-type]
            self._slots.extend([None] * len(lines))
            n = len(lines)
        self._lines += n
        self._count += n

    def reserve(self, count: int) -> int:
        """A place for ``count`` observer records whose lines :meth:`fill` gives later (they count from
        now on); returns the place."""
        self._items.append(_Reserved(count))
        self._slots.append(None)
        self._lines += count
        self._count += count
        return len(self._items) - 1

    def fill(self, place: int, lines: RecordLines) -> None:
        """The lines of the records reserved at ``place``."""
        reserved = self._items[place]
        if type(reserved) is not _Reserved or reserved.count != lines.count:
            raise ValueError(f"record place {place} was not reserved for {lines.count} records")
        self._items[place] = lines

    def _check_filled(self, items: list[Any]) -> None:
        if any(type(r) is _Reserved for r in items):
            raise RuntimeError("some records are not final until the capture ends (the observer reads "
                               "their statistics from the device then): read them after the capture")

    def fill_stats(self, rows: Sequence[dict[str, Any]]) -> None:
        """Each record's statistics from its row (``StatsBatch.to_host``'s dicts)."""
        for item, slot in zip(self._items, self._slots, strict=True):
            if slot is not None:
                item["stats"] = rows[slot]  # type: ignore[index]

    def fields(self, trusted: bool) -> list[Record] | list[dict[str, Any]]:
        """The records made from fields, for the manifest: built without validation when ``trusted``
        (every value made by this package has its field's type) and they pass :func:`_built_records`'
        checks, else the dicts, for pydantic to validate and say what is odd."""
        dicts: list[Any] = [r for r in self._items if type(r) is dict] if self._lines else self._items
        return _built_records(dicts) if trusted else dicts

    def unchecked(self) -> list[Record]:
        """The records made from fields, built as they are (after validation failed: what was recorded is kept)."""
        return [Record.model_construct(**{**r, "stats": Stats.model_construct(**r["stats"])
                                          if isinstance(r["stats"], dict) else r["stats"]})
                for r in self._items if type(r) is dict]  # type: ignore[arg-type]

    def settle(self, models: list[Record]) -> list[Record | bytes | RecordLines]:
        """The final records in execution order: ``models`` (made from :meth:`fields`) in their places
        between the observer's lines. Later reads (:meth:`records`) see these."""
        self._check_filled(self._items)
        if not self._lines:
            self._final = list(models)
        else:
            built = iter(models)
            self._final = [next(built) if type(r) is dict else r for r in self._items]  # type: ignore[misc]
        self._items, self._slots = [], []
        return self._final

    @property
    def has_lines(self) -> bool:
        """Some records are the observer's JSON lines (the bundle then stores every record as a line)."""
        return self._lines > 0

    def lines(self) -> list[bytes]:
        """The records the compiled observer handed over, as its JSON lines."""
        items: list[Any] = self._final if self._final is not None else self._items
        self._check_filled(items)
        out: list[bytes] = []
        for r in items:
            if type(r) is bytes:
                out.append(r)
            elif type(r) is RecordLines:
                out.extend(r.lines())
        return out

    def records(self) -> Iterator[Record]:
        """Every record so far as a :class:`~accuracy.manifest.Record`, in execution order."""
        items: list[Any] = self._final if self._final is not None else self._items
        self._check_filled(items)
        for r in items:
            if isinstance(r, Record):
                yield r
            elif type(r) is bytes:
                yield parse_record(r)
            elif type(r) is RecordLines:
                for line in r.lines():
                    yield parse_record(line)
            else:
                yield Record.model_construct(**r)


def _built(cls: type[Any], fields: dict[str, Any], fields_set: set[str]) -> Any:
    """``cls.model_construct(**fields)`` for a dict holding every field of ``cls`` (what
    ``model_validate`` makes of it when the values already have the fields' types), at a tenth of
    the cost: the records of one capture are built at its exit."""
    m = cls.__new__(cls)
    _setattr(m, "__dict__", fields)
    _setattr(m, "__pydantic_fields_set__", fields_set)  # every field: assigning one adds nothing
    _setattr(m, "__pydantic_extra__", None)
    _setattr(m, "__pydantic_private__", None)
    return m


def _built_records(records: list[dict[str, Any]]) -> list[Record] | list[dict[str, Any]]:
    """Records (and their statistics) built from the recorder's dicts without validation, which
    would find nothing to change: every value has its field's type already. The one check a field
    makes (keys of at most 4096 characters), the record kind and the number of fields are checked
    first; when a record fails them, the dicts are returned untouched, for validation to say why."""
    record_fields_set, stats_fields = set(Record.model_fields), set(Stats.model_fields)
    n_record, n_stats = len(record_fields_set), len(stats_fields)
    if not all(len(r["key"]) <= _MAX_KEY and r["kind"] in _KINDS and len(r) == n_record
               and (r["stats"] is None or len(r["stats"]) == n_stats) for r in records):
        return records
    stats: dict[int, Stats] = {}  # records that share a statistics row share its model
    out = []
    for r in records:
        s = r["stats"]
        if s is not None:
            model = stats.get(id(s))
            if model is None:
                model = stats[id(s)] = _built(Stats, s, stats_fields)
            r["stats"] = model  # the dict becomes the record's own __dict__
        out.append(_built(Record, r, record_fields_set))
    return out
