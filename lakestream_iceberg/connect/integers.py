"""Integers as Iceberg holds them: the ranges of Iceberg's ``int`` and ``long`` (Java's ``Integer`` and ``Long``),
named once for every wing. A rank, a world size and a field id are ints; a step, a seq, a snapshot id, a count and a
size are longs."""

from __future__ import annotations

__all__ = ["INT32_MAX", "INT32_MIN", "INT64_MAX", "INT64_MIN"]

INT32_MAX = 2**31 - 1  # Iceberg's int (Java's Integer.MAX_VALUE): a rank, a world size, a field id, a 32-bit property
INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1  # Iceberg's long (Java's Long.MAX_VALUE): a step, a seq, a snapshot id, a count or a size
INT64_MIN = -(2**63)
