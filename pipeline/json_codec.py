"""JSON on the million-row paths: msgspec's codec (several times faster than the stdlib's) with the stdlib's answers.

Every input line is decoded once, every work-list body and output record encoded once; at a million rows the
stdlib's codec alone costs tens of seconds. msgspec is used wherever it gives exactly what the stdlib would, and the
stdlib everywhere else:

- decoding: msgspec refuses what json.loads accepts (NaN/Infinity literals, integers beyond 64 bits, lone
  surrogates) and words its errors differently; such input is decoded again by the stdlib, so what is accepted and
  every error message are json.loads'.
- encoding: compact separators, non-ASCII kept as UTF-8, key order kept — as `json.dumps(ensure_ascii=False,
  separators=(",", ":"))`. What msgspec cannot write (integers beyond 64 bits, lone surrogates) goes to the stdlib.
  Non-finite floats differ: msgspec writes null, the stdlib the non-JSON `NaN`; `dumps_body` keeps the stdlib's
  bytes where a request body could hold one.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_NOT_ENCODABLE = (TypeError, OverflowError, ValueError, UnicodeEncodeError)

# Deepest nesting the decoders are asked to take. Both recurse per level (msgspec and the stdlib raise RecursionError
# somewhere near a thousand levels, less on a thread's smaller stack); no real request body comes close.
DEFAULT_MAX_DEPTH = 128


class JSONNestingError(ValueError):
    """JSON nested deeper than allowed: refused as input, never a RecursionError."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"JSON nested deeper than {max_depth} levels of objects/arrays")
        self.max_depth = max_depth


def depth(value: Any) -> int:
    """Levels of nested dicts/lists (a scalar is 0, `{}` is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _decode_bounded(raw: str | bytes, max_depth: int) -> tuple[Any, bool]:
    """(value, finite) with nesting bounded. Counting brackets is a C-speed pass over the line: a line with no more
    brackets than `max_depth` cannot nest deeper, so only the rare line with more pays for measuring the value."""
    array, obj = ("[", "{") if isinstance(raw, str) else (b"[", b"{")
    brackets = raw.count(array) + raw.count(obj)  # type: ignore[arg-type]
    try:
        try:
            value, finite = _decode(raw), True
        except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
            value, finite = json.loads(raw), False
    except RecursionError:
        raise JSONNestingError(max_depth) from None
    if brackets > max_depth and depth(value) > max_depth:
        raise JSONNestingError(max_depth)
    return value, finite


def loads(raw: str | bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """json.loads, fast on the common line; nesting deeper than `max_depth` raises JSONNestingError (a
    ValueError), as does anything the decoders could not take without exhausting the stack."""
    return _decode_bounded(raw, max_depth)[0]


def loads_finite(raw: str | bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[Any, bool]:
    """(value, finite): `finite` when msgspec decoded it, i.e. it holds no NaN/Infinity and `dumps` re-encodes it
    exactly. Nesting is bounded as in `loads`."""
    return _decode_bounded(raw, max_depth)


def _stdlib_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON with non-ASCII as is (a non-finite float becomes null: see the module doc)."""
    try:
        return _encode(value).decode()
    except _NOT_ENCODABLE:
        return _stdlib_dumps(value)


def redumps(value: Any, finite: bool) -> str:
    """Re-encode a value decoded by `loads_finite` exactly as the stdlib would: fast when it was `finite`."""
    return dumps(value) if finite else _stdlib_dumps(value)


def dumps_body(body: dict[str, Any], source: object = None) -> str:
    """A request body as the stdlib would write it. `source` is what it was decoded from: a raw line (json.loads
    yields non-finite floats only from NaN/Infinity literals, so a line without them is safe for msgspec), or an
    already-parsed row (Parquet), whose encoding is safe when it holds no null at all."""
    raw_line = isinstance(source, bytes)
    if not raw_line or (b"NaN" not in source and b"Infinity" not in source):
        try:
            encoded = _encode(body)
            if raw_line or b"null" not in encoded:
                return encoded.decode()
        except _NOT_ENCODABLE:
            pass
    return _stdlib_dumps(body)


def unicode_clean(value: Any) -> bool:
    """False when a string in `value` holds an unpaired UTF-16 surrogate (not Unicode: it cannot be written as
    UTF-8)."""
    try:
        _encode(value)
        return True
    except UnicodeEncodeError:
        return False
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        _stdlib_dumps(value).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
