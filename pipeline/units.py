"""Memory sizes: parsed from what people write ('80GiB', '24GB', '81559MiB') and printed in binary units."""

from __future__ import annotations

import re

GiB = 1 << 30

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_memory(text: str | int) -> int:
    """Bytes from '80GiB', '24GB', '81559MiB', '1.5TiB' or a plain byte count. GB is 10^9, GiB (or Gi) 2^30."""
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        match = _MEMORY.match(str(text))
        if not match or match.group(2).lower() not in _MEMORY_UNITS:
            raise ValueError(
                f"{text!r} is not a memory size: use a number with a unit, e.g. 80GiB, 24GB, 81559MiB, "
                f"or a byte count"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _MEMORY_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive memory size")
    return size


def fmt_bytes(n: int | float) -> str:
    """Binary units, three significant figures: 1.00 GiB, 257 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
