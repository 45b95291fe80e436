"""The position one trainer rank records (:mod:`lakestream_iceberg.read.consumer`) and ``lakestream lag`` reads back
(:mod:`lakestream_iceberg.read.lag`): a versioned JSON document, checked when read, since it comes from storage.

**The document** (one JSON object, version 1): ``stream`` (table UUID), ``branch``, ``world_size``, ``rank``,
``last_step`` (before the first step: the step before the one the rank starts at, None when it starts at step 1),
``steps`` (delivered since ``started_at``), ``started_at`` (unix seconds, the reporter's clock), ``elapsed_s`` and
``wait_s`` (since then: their ratio is the data-wait fraction), ``read_bytes`` (None when another process reads),
``report_s``, ``closed``, ``host``, ``pid``, ``workers``, ``source`` (``iterator``
or ``loader``). A restarted rank (a resumed checkpoint, another world size) overwrites its row with a fresh
``started_at``: its position continues from the step it resumed at.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from lakestream_iceberg.connect.integers import INT32_MAX, INT64_MAX, INT64_MIN
from lakestream_iceberg.errors import ConfigError, CorruptStateError

__all__ = ["MAX_GROUP_CHARS", "MAX_GROUP_QUOTED", "VERSION", "Position", "check_group"]

VERSION = 1
MAX_GROUP_CHARS = 200
MAX_GROUP_QUOTED = 255  # the longest file name of common file systems, in bytes
_SOURCES = ("iterator", "loader")
_MAX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last time a datetime holds


def check_group(group: object, *, recording: bool = False) -> str:
    """``group`` when it is a usable consumer group name (a non-empty string of printable characters, at most 200).

    ``recording`` (a dataset about to record positions under it): also at most 255 bytes URL-quoted. Outside a SQL
    catalog a group is one folder name of the object store, and file systems' names are at most 255 bytes (a non-ASCII
    letter quotes to 6-12, a '/' to 3); a longer name's every report failed in the background. Reading and deleting
    a group's positions take the longer names a SQL catalog may hold from before that bound.
    """
    if not isinstance(group, str) or not group.strip() or len(group) > MAX_GROUP_CHARS or not group.isprintable():
        raise ConfigError(f"group must be a non-empty printable string of at most {MAX_GROUP_CHARS} characters (a "
                          f"training run's name), got {group!r}")
    quoted = len(quote(group, safe=""))
    if recording and quoted > MAX_GROUP_QUOTED:
        raise ConfigError(f"group must be a name of at most {MAX_GROUP_QUOTED} bytes once URL-quoted (it names a "
                          f"folder of the object store; a non-ASCII letter takes 6 to 12, '/' and other punctuation "
                          f"3), got {group!r}, {quoted} bytes quoted: use a shorter or ASCII name")
    return group


@dataclass(frozen=True)
class Position:
    """One rank's recorded position (the document described in the module docstring), checked."""

    group: str
    rank: int
    stream: str
    branch: str
    world_size: int
    last_step: int | None
    steps: int
    started_at: float
    elapsed_s: float
    wait_s: float
    read_bytes: int | None
    report_s: float
    closed: bool
    host: str
    pid: int
    workers: int
    source: str

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "group"}
        return json.dumps({"v": VERSION, **fields}, separators=(",", ":"))

    @classmethod
    def parse(cls, body: str, *, group: str, rank: int) -> Position:
        """The position stored under (``group``, ``rank``).

        Raises:
            CorruptStateError: Not a position document of this key (malformed JSON, a field missing or of the wrong
                type, another rank's document, a version this release does not read).
        """
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested past the parser's stack
            raise CorruptStateError(f"the position of group {group!r} rank {rank} is not JSON ({exc}): "
                                    f"{body[:200]!r}") from None
        version = doc.get("v") if isinstance(doc, dict) else None
        if type(version) is int and version > VERSION:
            raise CorruptStateError(f"the position of group {group!r} rank {rank} is a version-{version} position "
                                    f"document, written by a newer lakestream release (this one reads version "
                                    f"{VERSION}): upgrade lakestream where the lag is read")
        if type(version) is not int or version != VERSION:  # not True, 1.0: those are not this version's documents
            raise CorruptStateError(f"the position of group {group!r} rank {rank} is not a version-{VERSION} position "
                                    "document")

        def field(name: str, kinds: tuple[type, ...], *, optional: bool = False) -> Any:
            value = doc.get(name)
            if value is None and optional:
                return None
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise CorruptStateError(f"the position of group {group!r} rank {rank} has a malformed {name!r}: "
                                        f"{value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise CorruptStateError(f"the position of group {group!r} rank {rank} has a non-finite {name!r}")
            if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
                raise CorruptStateError(f"the position of group {group!r} rank {rank} has an out-of-range {name!r}: "
                                        f"{value}")
            return value

        number = (int, float)
        position = cls(
            group=group, rank=field("rank", (int,)), stream=field("stream", (str,)), branch=field("branch", (str,)),
            world_size=field("world_size", (int,)), last_step=field("last_step", (int,), optional=True),
            steps=field("steps", (int,)), started_at=float(field("started_at", number)),
            elapsed_s=float(field("elapsed_s", number)), wait_s=float(field("wait_s", number)),
            read_bytes=field("read_bytes", (int,), optional=True), report_s=float(field("report_s", number)),
            closed=field("closed", (bool,)), host=field("host", (str,)), pid=field("pid", (int,)),
            workers=field("workers", (int,)), source=field("source", (str,)),
        )
        problems = [
            (position.rank != rank, f"rank {position.rank} (stored under rank {rank})"),
            (not 0 <= rank < position.world_size <= INT32_MAX, f"world_size {position.world_size} (rank {rank})"),
            (position.workers > INT32_MAX, f"workers {position.workers}"),
            (not 0 <= position.started_at <= _MAX_TIME, f"started_at {position.started_at}"),
            (position.last_step is not None and position.last_step < 0, f"last_step {position.last_step}"),
            (min(position.steps, position.pid, position.workers) < 0, "a negative count"),
            (min(position.elapsed_s, position.wait_s) < 0, "a negative duration"),
            (position.read_bytes is not None and position.read_bytes < 0, f"read_bytes {position.read_bytes}"),
            (position.report_s <= 0, f"report_s {position.report_s}"),
            (position.source not in _SOURCES, f"source {position.source!r}"),
        ]
        bad = [what for wrong, what in problems if wrong]
        if bad:
            raise CorruptStateError(f"the position of group {group!r} rank {rank} has {', '.join(bad)}")
        return position
