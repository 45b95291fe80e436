"""A table's storage through its own FileIO, PyArrow's or fsspec's: listing the files under a location (GC, staging,
consumer positions), the names in one folder (``Stream.create``'s check of a location), one file's modification time,
the store's clock (:func:`store_now`, what GC ages files by), a stream of ranged reads; and where s3fs (pyiceberg's ``FsspecFileIO``) differs from pyarrow: its listings cache
(dropped after each listing), its silent multi-object delete and its loose request bounds (warned of)."""

from __future__ import annotations

import logging
import posixpath
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from pyiceberg.io import FileIO

from lakestream_iceberg.connect.diagnose import explain, one_line
from lakestream_iceberg.connect.secrets import redact
from lakestream_iceberg.errors import ConfigError

log = logging.getLogger(__name__)


def norm(path: str) -> str:
    """A path without its scheme, so that ``file:/x``, ``file:///x`` and ``/x`` compare equal."""
    from urllib.parse import urlparse

    parsed = urlparse(path)
    return posixpath.normpath(f"{parsed.netloc}/{parsed.path}" if parsed.scheme else path).lstrip("/")


def list_files(io: FileIO, location: str, *,
               purpose: str = "garbage collection") -> Iterator[tuple[str, int, float | None]]:
    """Yield ``(full path, size in bytes, mtime as unix seconds)`` for every file below ``location``; ``purpose`` (what
    the listing is for) is named by the error when it fails. The mtime is None where the store does not tell it:
    callers must take such a file as young (it was read as 0, the epoch, and GC deleted such files at once)."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    if isinstance(io, PyArrowFileIO):
        from pyarrow import fs as pafs

        scheme, netloc, path = PyArrowFileIO.parse_location(location, io.properties)
        filesystem = io.fs_by_scheme(scheme, netloc)
        # what the location holds before the path (nothing for a plain path): a plain location's trailing / made it
        # file://, and a # or ? in the path then read as a fragment or query, so GC matched none of its files
        trimmed, bare = location.rstrip("/"), path.rstrip("/")
        prefix = trimmed[: len(trimmed) - len(bare)] if trimmed.endswith(bare) else f"{scheme}://"
        try:
            infos = filesystem.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
        except OSError as exc:
            raise _listing_error(exc, io, location, purpose) from None
        for info in infos:
            if info.type == pafs.FileType.File:
                yield prefix + info.path, int(info.size or 0), info.mtime.timestamp() if info.mtime is not None else None
        return
    filesystem = _fsspec_filesystem(io, location)
    if filesystem is not None:
        from urllib.parse import urlparse

        scheme = urlparse(location).scheme
        try:
            found = filesystem.find(location, detail=True)
        except FileNotFoundError:  # no bucket (a prefix that holds nothing lists as empty)
            found = {}
        except Exception as exc:  # noqa: BLE001 - s3fs raises botocore's own errors for a store out of reach
            raise _listing_error(exc, io, location, purpose) from None
        finally:
            forget_listings(filesystem, location)
        for path, info in found.items():
            full = path if "://" in path or not scheme else f"{scheme}://{path}"  # a plain path stays one
            yield full, int(info.get("size") or 0), _fsspec_mtime(info)
        return
    raise ConfigError(f"{purpose} cannot list files through {type(io).__name__}; use PyArrowFileIO or FsspecFileIO")


def _fsspec_mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time in an fsspec listing or ``info`` (unix seconds; None: not told). Each file system
    names it its own way: s3fs ``LastModified``, the local one and gcsfs ``mtime``, adlfs (``abfs://``, pyiceberg's
    default FileIO for Azure) ``last_modified``, which went unread, so every file there read as from 1970."""
    mtime = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if not mtime:
        return None
    return mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)


def _listing_error(exc: Exception, io: FileIO, location: str, purpose: str) -> ConfigError:
    """The :class:`ConfigError` for a listing the store refused: naming the setting when it is a credential or
    endpoint failure (:func:`~lakestream_iceberg.connect.diagnose.explain`), the store's own words otherwise. The
    original is kept as ``error.original``, not chained (its text is unredacted)."""
    error = explain(exc, io.properties, action=f"listing {location} for {purpose}")
    if error is None:
        error = ConfigError(redact(f"cannot list {location} for {purpose}: {one_line(exc, 400)}", io.properties))
        error.original = exc  # type: ignore[attr-defined]
    return error


def list_folder(io: FileIO, location: str) -> list[str] | None:
    """The names of the files and folders directly in ``location`` (none when it does not exist), through the table's
    own FileIO; None when they cannot be told (the store cannot be listed, a FileIO that lists nothing)."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    try:
        if isinstance(io, PyArrowFileIO):
            from pyarrow import fs as pafs

            scheme, netloc, path = PyArrowFileIO.parse_location(location, io.properties)
            selector = pafs.FileSelector(path.rstrip("/"), recursive=False, allow_not_found=True)
            return [info.base_name for info in io.fs_by_scheme(scheme, netloc).get_file_info(selector)]
        filesystem = _fsspec_filesystem(io, location)
        if filesystem is None:
            return None
        try:
            found = filesystem.ls(location, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        finally:
            forget_listings(filesystem, location)
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in found]
    except Exception:  # noqa: BLE001 - no folder, no permission, an unreachable endpoint (botocore's own errors too)
        return None


def _fsspec_filesystem(io: FileIO, location: str) -> Any:
    """The fsspec file system an ``FsspecFileIO`` reads ``location`` with; None for any other FileIO."""
    fsspec_io = sys.modules.get("pyiceberg.io.fsspec")  # not imported: no FsspecFileIO exists (and fsspec stays unloaded)
    if fsspec_io is None or not isinstance(io, fsspec_io.FsspecFileIO):
        return None
    from urllib.parse import urlparse

    parsed = urlparse(location)
    if parsed.scheme in ("abfs", "abfss", "wasb", "wasbs"):  # one file system per storage account, as pyiceberg's
        return io.get_fs(parsed.scheme, parsed.hostname)
    return io.get_fs(parsed.scheme)


def open_ranged(io: FileIO, path: str) -> Any:
    """A seekable stream of the file at ``path`` whose reads fetch the bytes they ask for and no more: for a reader
    that reads parts of a file (one rank's row groups of a packed step).

    pyiceberg's ``FsspecFileIO`` opens files with fsspec's read-ahead cache of s3fs's default block (50 MiB): each
    read fetched from its offset up to 50 MiB more, so a rank reading its eighth of a 96 MiB packed step fetched 60
    MiB of it. Here a read fetches its range (and ``pre_buffer`` coalesces a row group's column chunks), as through
    ``PyArrowFileIO``."""
    filesystem = _fsspec_filesystem(io, path)
    if not _through_s3fs(filesystem):
        return io.new_input(path).open(seekable=True)
    return filesystem.open(path, "rb", cache_type="none")


def forget_listings(filesystem: object, location: str) -> None:
    """Drop what an fsspec file system's listings cache holds at or below ``location``.

    ``find`` fills s3fs's (and gcsfs's, adlfs's) directory cache with every folder it listed, and that cache never
    expires: ``info`` and ``open`` then answer from it, so a file another process wrote after the listing reads as
    missing (a new ``metadata.json``: the stream could not refresh) and one it overwrote or deleted keeps its old size
    or still exists. Another process writes under a stream's location all the time; nothing here may trust a listing
    once it has been read.

    Safe from any thread: s3fs is one file system (one cache) per process for every thread, and ``pop`` of the cache
    (a ``MutableMapping``: a read, then a delete) raised ``KeyError`` where another thread deleted the key in between."""
    cache = getattr(filesystem, "dircache", None)
    strip = getattr(filesystem, "_strip_protocol", None)
    if cache is None or strip is None:
        return
    root = str(strip(location)).rstrip("/")
    for key in [key for key in list(cache) if key == root or key.startswith(root + "/")]:
        try:
            del cache[key]  # one step: a dict's delete
        except KeyError:  # another thread's listing dropped it first
            pass


def unreported_delete_failures(io: FileIO, location: str) -> bool:
    """Whether a delete ``io`` makes under ``location`` can fail without saying so: ``FsspecFileIO`` deletes an S3
    object through s3fs's multi-object delete, and s3fs drops the per-object errors of its answer (a bucket policy
    without ``s3:DeleteObject``, an object under Object Lock): the file stays and the delete returns."""
    return _through_s3fs(_fsspec_filesystem(io, location))


def _through_s3fs(filesystem: Any) -> bool:
    """Whether ``filesystem`` (an fsspec file system, or None) is s3fs."""
    return filesystem is not None and "s3" in tuple(getattr(filesystem, "protocol", ()) or ())


_TIME_BOUNDS = ("s3.connect-timeout", "s3.request-timeout")
_warned_bounds = False


def warn_unbounded_requests(io: FileIO, location: str) -> None:
    """Warn, once per process, when ``io`` reaches S3 through s3fs without both of ``s3.connect-timeout`` and
    ``s3.request-timeout``: botocore then waits 60 s per attempt, and s3fs retries each request 5 times on top of
    botocore's attempts, so one request to an endpoint that stops answering took 410 s (PyArrowFileIO: 10 s), longer
    than lakestream's own read and commit budgets. Setting both (and ``AWS_MAX_ATTEMPTS=1``) brought it to 17 s."""
    global _warned_bounds
    if _warned_bounds or not _through_s3fs(_fsspec_filesystem(io, location)):
        return
    missing = [key for key in _TIME_BOUNDS if not io.properties.get(key)]
    if not missing:
        return
    _warned_bounds = True
    log.warning("pyiceberg's FsspecFileIO (s3fs) reaches S3 without %s: a request to a store that stops answering "
                "then waits minutes (botocore's 60 s per attempt, and s3fs's 5 retries on top of botocore's), past "
                "lakestream's own read and commit budgets; set s3.connect-timeout and s3.request-timeout (seconds) "
                "in the catalog's properties, or use PyArrowFileIO (no py-io-impl); see docs/guide/hosts.md",
                " and ".join(missing))


CLOCK_PROBE_PREFIX = "_lakestream-clock-"  # a probe object's name under the table's metadata/ folder (see store_now)
# stores that serve Iceberg tables (S3 table buckets, SeaweedFS's) accept only Avro, Parquet and metadata JSON there
CLOCK_PROBE_SUFFIX = ".avro"


def store_now(io: FileIO, location: str) -> float | None:
    """The store's clock now (unix seconds): the modification time of an empty probe object that this writes under
    ``<location>/metadata/`` and deletes at once. None when it cannot be told (the write refused, a FileIO or store that
    reports no modification times). A probe left behind (its delete failed) is a file no metadata references: the next
    GC deletes it once it is older than the grace period.

    Ages of files are differences between their modification times (the store's clock) and now: taken from this host's
    clock, a host whose clock runs ahead of the store's sees every file that much older (GC deleting the files of a
    commit in flight, consumer positions expired early)."""
    path = f"{location.rstrip('/')}/metadata/{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}{CLOCK_PROBE_SUFFIX}"
    try:
        with io.new_output(path).create(overwrite=True) as f:
            f.write(b"")
    except Exception:  # noqa: BLE001 - read-only credentials, a store out of reach: the caller uses its own clock
        return None
    try:
        return modified_at(io, path)
    finally:
        try:
            io.delete(path)
        except Exception:  # noqa: BLE001 - left for GC (see above)
            pass


def modified_at(io: FileIO, path: str) -> float | None:
    """When the file at ``path`` was last modified (unix seconds, by the store's clock), or None when that cannot be
    told (no such file, a FileIO that lists no times, an error of the store)."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    try:
        if isinstance(io, PyArrowFileIO):
            from pyarrow import fs as pafs

            scheme, netloc, bare = PyArrowFileIO.parse_location(path, io.properties)
            info = io.fs_by_scheme(scheme, netloc).get_file_info(bare)
            return info.mtime.timestamp() if info.type == pafs.FileType.File and info.mtime is not None else None
        from pyiceberg.io.fsspec import FsspecFileIO

        if isinstance(io, FsspecFileIO):
            from urllib.parse import urlparse

            return _fsspec_mtime(io.get_fs(urlparse(path).scheme).info(path))
    except Exception:  # noqa: BLE001 - a store's own errors too (s3fs raises botocore's for an unreachable endpoint)
        return None
    return None
