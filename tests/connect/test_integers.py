"""The ranges of Iceberg's int and long have one name each (``connect/integers.py``), and integers written as text are
read as Iceberg's Java engines read them (:func:`parse_int`)."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

import lakestream_iceberg
from lakestream_iceberg.connect.integers import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, parse_int

PACKAGE = Path(lakestream_iceberg.__file__).parent
_LIMITS = {"2147483647", "2147483648", "2_147_483_647", "9223372036854775807", "9223372036854775808"}


def _spelled_limits(source: str) -> list[str]:
    """The int32 / int64 limits spelled out in code (not in docstrings or comments): ``2**31``, ``1 << 63``, the
    literals."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    found = []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NUMBER and tok.string in _LIMITS:
            found.append(f"line {tok.start[0]}: {tok.string}")
        nxt = tokens[i + 1:i + 3]
        if tok.type == tokenize.NUMBER and tok.string in ("1", "2") and len(nxt) == 2 and \
                nxt[0].string == ("**" if tok.string == "2" else "<<") and nxt[1].string in ("31", "32", "63", "64"):
            found.append(f"line {tok.start[0]}: {tok.string} {nxt[0].string} {nxt[1].string}")
    return found


def test_int_limits_are_spelled_once() -> None:
    """The largest int32 was spelled ``2**31 - 1`` (a property's bound), ``MAX_RANK`` (positions), ``_INT32`` (consumer
    positions) and ``< 2**31`` (staged intents), the largest long four ways more; each is one name now."""
    spelled = {str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "integers.py" and (hits := _spelled_limits(path.read_text(encoding="utf-8")))}
    assert spelled == {}, f"use lakestream_iceberg.connect.integers' INT32_MAX / INT64_MAX instead: {spelled}"


def test_limits() -> None:
    assert (INT32_MIN, INT32_MAX, INT64_MIN, INT64_MAX) == (-(2**31), 2**31 - 1, -(2**63), 2**63 - 1)


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), ("5", 5), ("-5", -5), ("+5", 5), ("007", 7), ("-0", 0), ("0" * 40 + "12", 12),
    (str(INT64_MAX), INT64_MAX), (str(INT64_MIN), INT64_MIN),
])
def test_parse_int_reads_what_java_reads(text: str, expected: int) -> None:
    assert parse_int(text) == expected


@pytest.mark.parametrize("text", [
    " 5", "5 ", "\t5", "5\n", "5_000", "٥", "５", "²", "", "-", "+", "+-5", "--5", "5.0", "5e3", "0x10", "five",
    str(INT64_MAX + 1), str(INT64_MIN - 1), "9" * 5000,
])
def test_parse_int_refuses_what_java_refuses(text: str) -> None:
    """Python's int() reads every one of these but the last five (and the 5000 digits with an error of its own); Java's
    Long.parseLong refuses them, but for the non-ASCII digits, which no engine writes."""
    assert parse_int(text) is None


def test_parse_int_bounds_and_plus() -> None:
    assert parse_int(str(INT32_MAX), maximum=INT32_MAX) == INT32_MAX
    assert parse_int(str(INT32_MAX + 1), maximum=INT32_MAX) is None
    assert parse_int("-1", minimum=0) is None
    assert parse_int("+5", plus=False) is None and parse_int("-5", plus=False) == -5
    assert parse_int(5) is None and parse_int(None) is None and parse_int(True) is None
