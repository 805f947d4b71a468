"""Strict JSON for bundle headers and manifests: duplicate keys and NaN/Infinity literals refused."""

from __future__ import annotations

import json
from typing import Any

from accuracy.errors import BundleError


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for json.loads: plain json keeps the last of two equal keys silently."""
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the first repeated key to name it
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BundleError(f"duplicate JSON key {key!r}: a bundle header must name each entry once")
            seen.add(key)
    return out


def _refuse_constant(name: str) -> Any:
    raise BundleError(f"JSON constant {name} is not allowed in a bundle header (use a string)")


def loads_strict(raw: str | bytes, what: str) -> Any:
    """JSON with duplicate keys and NaN/Infinity literals refused, errors as BundleError."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise BundleError(f"{what} is not valid UTF-8 (byte {e.start}): {e.reason}") from e
    except json.JSONDecodeError as e:
        raise BundleError(f"{what} is not valid JSON: {e}") from e
    except RecursionError as e:
        raise BundleError(f"{what} nests too deeply") from e
