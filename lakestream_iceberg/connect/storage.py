"""Listing the files under a table location through the table's own FileIO (PyArrow or fsspec), for GC, and one file's
modification time."""

from __future__ import annotations

from collections.abc import Iterator

from pyiceberg.io import FileIO

from lakestream_iceberg.errors import ConfigError


def list_files(io: FileIO, location: str, *, purpose: str = "garbage collection") -> Iterator[tuple[str, int, float]]:
    """Yield ``(full path, size in bytes, mtime as unix seconds)`` for every file below ``location``; ``purpose`` (what
    the listing is for) is named by the error when it fails."""
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
            raise ConfigError(f"cannot list {location} for {purpose}: {exc}") from exc
        for info in infos:
            if info.type == pafs.FileType.File:
                mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
                yield prefix + info.path, int(info.size or 0), mtime
        return
    try:
        from pyiceberg.io.fsspec import FsspecFileIO
    except ImportError:  # pragma: no cover - fsspec not installed
        FsspecFileIO = None  # type: ignore[assignment,misc]
    if FsspecFileIO is not None and isinstance(io, FsspecFileIO):
        from urllib.parse import urlparse

        parsed = urlparse(location)
        filesystem = io.get_fs(parsed.scheme)
        for path, info in filesystem.find(location, detail=True).items():
            full = path if "://" in path else f"{parsed.scheme}://{path}"
            mtime = info.get("LastModified") or info.get("mtime") or 0
            yield full, int(info.get("size") or 0), (mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime))
        return
    raise ConfigError(f"{purpose} cannot list files through {type(io).__name__}; use PyArrowFileIO or FsspecFileIO")


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

            found = io.get_fs(urlparse(path).scheme).info(path)
            mtime = found.get("LastModified") or found.get("mtime")
            return mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime) if mtime else None
    except Exception:  # noqa: BLE001 - a store's own errors too (s3fs raises botocore's for an unreachable endpoint)
        return None
    return None
