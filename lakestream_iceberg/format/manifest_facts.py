"""What a manifest and its entries say about a stream, read without opening anything: a manifest's merge level (from
its file name), the ``_step`` range it covers (from its partition summary), and a data file's step.
"""

from __future__ import annotations

import functools
import re
from typing import cast

from pyiceberg.conversions import from_bytes
from pyiceberg.manifest import DataFile, ManifestFile
from pyiceberg.types import LongType

__all__ = ["entry_step", "manifest_level", "step_bounds", "stream_entry"]

_LEVEL_RE = re.compile(r"-L([0-9]{1,9})-m[0-9]+\.avro$")  # ASCII digits (\d takes "٣"), an int's


@functools.lru_cache(maxsize=4096)  # a head lists a few dozen manifests; a plan asks each of them once per level
def manifest_level(path: str) -> int:
    """The merge level encoded in a manifest's file name; manifests written by other engines count as level 0.

    Cached: every commit asks it of every manifest in the list, once per level."""
    match = _LEVEL_RE.search(path)
    return int(match.group(1)) if match else 0


def entry_step(data_file: DataFile) -> int | None:
    """A data file's ``_step``, or None when it has none a step could be (steps are integers >= 1): a row another engine
    appended with a null or non-positive step is no step's file; reads skip it and GC collects it with the first
    steps it collects."""
    partition = data_file.partition
    step = partition[0] if len(partition) else None
    return step if type(step) is int and step >= 1 else None


def stream_entry(data_file: DataFile) -> bool:
    """Whether a data file has a stream's partition: ``(_step,)`` (packed) or ``(_step, _rank)``, integers, step >= 1,
    rank >= 0."""
    partition = data_file.partition
    if entry_step(data_file) is None or len(partition) not in (1, 2):
        return False
    return len(partition) == 1 or (type(partition[1]) is int and partition[1] >= 0)


def step_bounds(manifest: ManifestFile) -> tuple[int, int] | None:
    """The ``_step`` range a manifest covers, from its partition summary (None when unknown or malformed: the manifest's
    entries are read and checked instead)."""
    if not manifest.partitions:
        return None
    summary = manifest.partitions[0]
    if summary.lower_bound is None or summary.upper_bound is None:
        return None
    if len(summary.lower_bound) != 8 or len(summary.upper_bound) != 8:  # a long is 8 bytes (Iceberg single-value)
        return None
    # pyiceberg's from_bytes is typed as returning its first constrained type (str); for a LongType it returns an int
    return cast(int, from_bytes(LongType(), summary.lower_bound)), cast(int, from_bytes(LongType(), summary.upper_bound))
