"""Integers as Iceberg holds them and its Java engines spell them: the ranges of Iceberg's ``int`` and ``long``, and
:func:`parse_int`, the one reader of an integer written as text (a table property, a snapshot summary value, a field
of a staged intent or a name lakestream gives a file).

Python's ``int()`` reads more than Iceberg's engines do: ``" 5"``, ``"5_000"`` and ``"٥"`` (an Arabic-Indic five) are
all 5 to it, while Spark and Trino read a table property with Java's ``Integer.parseInt`` / ``Long.parseLong``, which
refuse spaces and underscores. A value lakestream took would then fail another engine, and a value read back from
storage would be taken for a number nobody wrote. :func:`parse_int` reads what Java reads, less its non-ASCII digits
(Java takes ``"٥"``; no engine writes one): ASCII digits with an optional leading ``-`` or ``+``, within the range
the caller gives (an Iceberg long's by default). It answers None for anything else; the caller raises its own error
(a :class:`~lakestream_iceberg.errors.ConfigError` naming a property, a
:class:`~lakestream_iceberg.errors.CorruptStateError` naming a snapshot).

Example:
    >>> parse_int("42"), parse_int("+42"), parse_int(" 42"), parse_int("4_2"), parse_int("2147483648", maximum=INT32_MAX)
    (42, 42, None, None, None)
"""

from __future__ import annotations

import re

__all__ = ["INT32_MAX", "INT32_MIN", "INT64_MAX", "INT64_MIN", "parse_int"]

INT32_MAX = 2**31 - 1  # Iceberg's int (Java's Integer.MAX_VALUE): a rank, a world size, a field id, a 32-bit property
INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1  # Iceberg's long (Java's Long.MAX_VALUE): a step, a seq, a snapshot id, a count or a size
INT64_MIN = -(2**63)

# Leading zeros are Java's too ("007" is 7); past them at most 19 digits (a long has 19): the range check does the rest,
# and Python's int() never sees the 4300 digits it refuses with an error of its own
_INTEGER = re.compile(r"([+-]?)0*([0-9]{1,19})", re.ASCII)


def parse_int(text: object, *, minimum: int = INT64_MIN, maximum: int = INT64_MAX, plus: bool = True) -> int | None:
    """The integer ``text`` spells as Java's ``Long.parseLong`` reads it, within ``minimum..maximum``; else None.

    Args:
        text: The string read (anything else, a bool or an int included, is None: stored values are strings).
        minimum, maximum: Inclusive bounds (default: an Iceberg long's range).
        plus: Whether a leading ``+`` is taken (Java takes it; lakestream never writes one into what it stores, and
            the readers of its own stored values refuse it).
    """
    if not isinstance(text, str):
        return None
    match = _INTEGER.fullmatch(text)
    if match is None or match[1] == "+" and not plus:
        return None
    value = int(match[1] + match[2])
    return value if minimum <= value <= maximum else None
