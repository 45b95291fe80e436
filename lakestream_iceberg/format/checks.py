"""Argument checks shared by every wing: integers that cross the API, and the branch a producer publishes into.

**Integers.** Every integer the API takes (a producer's ``seq``, a ``step``, a ``rank``, a ``world_size``,
``keep_last``, ...) goes through :func:`check_int`: a Python ``int`` or anything that implements ``__index__`` (numpy
integers) is accepted and returned as a plain ``int``; a ``bool`` is refused (``True == 1`` in Python, and a ``True``
once written into a snapshot summary as the string ``"True"`` is not a number any more), and so are floats (even
integral ones), strings and ``None``. The caller names the value and picks the :class:`LakestreamError` subclass.
An integer written as text (a table property, a snapshot summary value) is read by
:func:`~lakestream_iceberg.connect.integers.parse_int` instead.

**Branches.** A producer publishes into an existing branch only (``main``, which an empty stream does not have yet, or
one made by ``fork``): a tag name would turn a checkpoint tag into a branch, and a typo would start a parentless
lineage at step 1. :func:`check_branch` is used when a producer is made and again in every commit plan.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from typing import Literal, SupportsIndex, cast, overload

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType

from lakestream_iceberg.connect.integers import INT64_MAX
from lakestream_iceberg.errors import ConfigError, LakestreamError

__all__ = ["MAX_STEP", "branches", "check_bool", "check_branch", "check_catalog", "check_identifier", "check_int", "check_location",
           "check_new_identifier", "check_seconds"]


MAX_STEP = INT64_MAX  # a step is an Iceberg long: a larger one is never published (reading or waiting for it is a mistake)


def check_int(value: object, *, what: str, error: type[LakestreamError] = ConfigError, minimum: int | None = None,
              maximum: int | None = None, hint: str = "") -> int:
    """``value`` as a plain ``int``, or ``error`` naming ``what``.

    Args:
        value: The value the caller passed.
        what: Its name in the message (``"seq"``, ``"rank"``, ``"keep_last"``).
        error: The :class:`LakestreamError` subclass to raise.
        minimum, maximum: Inclusive bounds (None: unbounded).
        hint: Appended to the message (what to do instead).

    Raises:
        error: ``value`` is a bool, not an integer, or out of bounds.
    """
    suffix = f" ({hint})" if hint else ""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):  # numpy and torch bools too
        raise error(f"{what} must be an integer, got the bool {value!r}{suffix}")
    try:
        # any object: one without __index__ raises TypeError, handled below (cheaper than isinstance on the protocol)
        number = operator.index(cast(SupportsIndex, value))  # int, numpy integers; not float, str, None, numpy bool
    except TypeError:
        raise error(f"{what} must be an integer, got {value!r} ({type(value).__name__}){suffix}") from None
    if minimum is not None and number < minimum or maximum is not None and number > maximum:
        bounds = f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None else f"in {minimum}..{maximum}"
        raise error(f"{what} must be {bounds}, got {number}{suffix}")
    return number


def check_bool(value: object, *, what: str, error: type[LakestreamError] = ConfigError) -> bool:
    """``value`` when it is ``True`` or ``False``: ``bool("false")`` is True, so a flag never takes a truthy string."""
    if not isinstance(value, bool):
        raise error(f"{what} must be True or False, got {value!r}")
    return value


@overload
def check_seconds(value: object, *, what: str, minimum: float = 0.0, allow_none: Literal[False] = False,
                  error: type[LakestreamError] = ConfigError) -> float: ...
@overload
def check_seconds(value: object, *, what: str, minimum: float = 0.0, allow_none: bool,
                  error: type[LakestreamError] = ConfigError) -> float | None: ...
def check_seconds(value: object, *, what: str, minimum: float = 0.0, allow_none: bool = False,
                  error: type[LakestreamError] = ConfigError) -> float | None:
    """``value`` as a finite number of seconds >= ``minimum`` (``None`` when ``allow_none``), never a bool or NaN."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) or value < minimum:
        raise error(f"{what} must be a finite number of seconds >= {minimum:g}{' (or None)' if allow_none else ''}, "
                    f"got {value!r}")
    return float(value)


def _finite(value: numbers.Real) -> bool:
    """Whether ``value`` is a finite float: an integer past a float's range (``10**400``) raised OverflowError out of
    ``math.isfinite``, not the ConfigError naming the argument."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_identifier(identifier: object) -> str | tuple[str, ...]:
    """``identifier`` when it is a stream's ``"namespace.name"`` or pyiceberg's ``("namespace", "name")`` (a nested
    namespace may have more parts), else :class:`ConfigError`: pyiceberg would raise a bare ``ValueError`` for an
    empty or blank part."""
    parts = identifier.split(".") if isinstance(identifier, str) else identifier
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or \
            any(not isinstance(part, str) or not part.strip() or "." in part for part in parts):  # a dotted part would
        # reopen as another name: a stream travels to workers as its dotted name
        raise ConfigError(f"a stream is named 'namespace.name' (no empty part), got {identifier!r}")
    return identifier if isinstance(identifier, str) else tuple(parts)


# A name part becomes a folder of the table's default location (<warehouse>/<namespace>/<name>): a '/' made "ns.a/b"
# and "ns/a.b" one folder (two streams sharing files, each one's GC deleting the other's), a control character or NUL
# is refused by storage midway through creating, and so is a folder name past 255 bytes (most file systems' limit)
_PART_BYTES = 255


def check_new_identifier(identifier: str | tuple[str, ...]) -> None:
    """Refuse a checked identifier (:func:`check_identifier`) whose parts cannot each be one folder name of the new
    stream's location: a ``/``, a control character, white space at its start or end (``"ns.s "`` made a second
    stream beside ``ns.s``, where pyiceberg opens ``" ns.s"`` as ``ns.s``), or more than 255 bytes (UTF-8) in a part
    or in a nested namespace's parts joined by ``.`` (one folder: ``<warehouse>/a.b/name``)."""
    parts = identifier.split(".") if isinstance(identifier, str) else identifier
    for part in parts:
        problem = ("holds a path separator ('/' or '\\')" if "/" in part or "\\" in part
                   else "starts or ends with white space" if part != part.strip()
                   else "holds a control character" if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in part)
                   else f"is longer than {_PART_BYTES} bytes" if len(part.encode("utf-8", "surrogatepass")) > _PART_BYTES
                   else None)
        if problem is not None:
            raise ConfigError(
                f"cannot create a stream named {identifier!r}: the part {part[:40]!r}{'...' if len(part) > 40 else ''} "
                f"{problem}; each part of 'namespace.name' becomes a folder of the stream's location, so use at most "
                f"{_PART_BYTES} bytes without '/', '\\', control characters or white space at either end (e.g. "
                "'train.run_42')")
    namespace = ".".join(parts[:-1])  # a nested namespace is one folder, its parts joined by '.' (pyiceberg's)
    if len(namespace.encode("utf-8", "surrogatepass")) > _PART_BYTES:
        raise ConfigError(
            f"cannot create a stream named {identifier!r}: its namespace {namespace[:40]!r}... is longer than "
            f"{_PART_BYTES} bytes with its parts joined by '.', and it becomes one folder of the stream's location; "
            "use a shorter namespace (e.g. 'train.run_42')")


def check_location(location: object) -> str | None:
    """``location`` when it is ``None`` (the catalog's warehouse decides) or a URI or absolute path; a relative path
    is refused: every process would resolve it from its own working directory, and find another table's files or
    none."""
    if location is None:
        return None
    if not isinstance(location, str) or not location.strip():
        raise ConfigError(f"location must be a URI (s3://bucket/path, file:///path) or an absolute path, or None for "
                          f"the catalog's warehouse, got {location!r}")
    # a URI (s3://b/p, and file:/abs/p as Spark and Hadoop write a local location), an absolute path or a drive's
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", location) and not location.startswith("/") and \
            not re.match(r"[A-Za-z]:\\", location):
        raise ConfigError(f"location {location!r} is a relative path: each process would resolve it from its own "
                          "working directory; give a URI (s3://bucket/path, file:///path) or an absolute path")
    return location


def check_catalog(catalog: object) -> None:
    """Refuse what is not a pyiceberg catalog, before an ``AttributeError`` deep inside says so."""
    from pyiceberg.catalog import Catalog

    if not isinstance(catalog, Catalog):
        hint = (f"; load it with lakestream_iceberg.load_catalog({catalog!r})" if isinstance(catalog, str)
                else " (lakestream_iceberg.load_catalog(name) or pyiceberg's load_catalog(name) returns one)")
        raise ConfigError(f"catalog must be a pyiceberg Catalog, got {type(catalog).__name__} {catalog!r}"[:300] + hint)


def branches(metadata: TableMetadata) -> list[str]:
    """The stream's branches (``main`` always, even before its first snapshot)."""
    return sorted({MAIN_BRANCH} | {n for n, r in metadata.refs.items() if r.snapshot_ref_type == SnapshotRefType.BRANCH})


def check_branch(metadata: TableMetadata, branch: object, *, stream: str, doing: str,
                 error: type[LakestreamError] = ConfigError) -> str:
    """``branch`` when it is a branch of ``metadata`` (or ``main`` with no ref yet), else ``error``.

    ``doing`` starts the message, e.g. ``"cannot make producer 'p' on"``.
    """
    if not isinstance(branch, str):
        problem = f"the branch name must be a string, got {type(branch).__name__}"
    else:
        ref = metadata.refs.get(branch)
        if ref is None and branch == MAIN_BRANCH or ref is not None and ref.snapshot_ref_type == SnapshotRefType.BRANCH:
            return branch
        problem = (f"{branch!r} is a tag (a checkpoint), not a branch" if ref is not None
                   else f"it has no branch {branch!r}")
    raise error(
        f"{doing} branch {branch!r} of {stream}: {problem}. Its branches are: {', '.join(branches(metadata))} (main, "
        "and those made with stream.fork(checkpoint, branch=...))"
    )
