"""Reopening a stream in another process: a DataLoader worker, a Ray task, a relay client.

:class:`StreamRef` is what such a process needs to open the same stream: pyiceberg catalogs hold live database
engines or HTTP sessions and do not pickle, so the catalog's class, name and non-secret properties are carried instead
and the catalog is rebuilt with ``load_catalog`` in the worker, which takes the credentials from its own pyiceberg
configuration (see :class:`StreamRef`). :func:`forked_view` gives a forked process its own view of a stream its parent
opened without asking the catalog at all, where the catalog allows it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.utils.config import Config, merge_config

from lakestream_iceberg.connect.catalog_settings import env_name, resolve
from lakestream_iceberg.connect.diagnose import config_errors, load_catalog, transient
from lakestream_iceberg.connect.fork import fork_safe, owns_connections
from lakestream_iceberg.connect.metadata_read import MALFORMED, malformed_metadata, unparsable
from lakestream_iceberg.connect.secrets import redact, redacted, split_secrets
from lakestream_iceberg.errors import ConfigError, LakestreamError
from lakestream_iceberg.format.table import StreamTable

__all__ = ["PY_CATALOG_IMPL", "StreamRef", "forked_view", "travelling_properties"]

PY_CATALOG_IMPL = "py-catalog-impl"
_AWS_KEY_IDS = ("s3.access-key-id", "client.access-key-id")  # pyiceberg's S3 FileIO: the first set is used
_AWS_SECRETS = ("s3.secret-access-key", "client.secret-access-key")


def travelling_properties(properties: Mapping[Any, Any]) -> dict[str, str]:
    """A catalog's properties as another process gets them: as strings, as pyiceberg's configuration gives them.

    pyiceberg and lakestream read a number given as a keyword argument (``s3.connect-timeout=5``,
    ``rest.client.socket-timeout-ms=5000``) as they read its string; it must not be lost on the way to a worker, nor the
    worker's configured value used instead. ``None`` (a setting left unset) and values of no plain type stay behind."""
    out: dict[str, str] = {}
    for key, value in properties.items():
        if isinstance(value, bool):
            out[str(key)] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[str(key)] = str(value)
    return out


@dataclass(frozen=True)
class StreamRef:
    """A picklable address of a stream: enough to reopen it in another process.

    **Credentials stay out of pickles.** ``catalog_properties`` holds the catalog's non-secret properties only; its
    credentials (every property :func:`~lakestream_iceberg.connect.secrets.is_secret_key` calls secret, e.g.
    ``s3.secret-access-key``, and a ``uri`` with a password) are kept in ``secrets``, which this process and its forked
    children use but a pickle never carries. The process that unpickles resolves them the way pyiceberg does, for the
    same catalog name: ``.pyiceberg.yaml`` (``$PYICEBERG_HOME``) and ``PYICEBERG_CATALOG__<NAME>__<KEY>`` environment
    variables, explicit (pickled) properties winning over configured ones.

    ``StreamRef.of(stream, include_secrets=True)`` ships the credentials in the pickle, in clear text: anything that
    sees the pickle (a task queue, a cluster scheduler's logs, a core dump) sees the secrets. Use it only where the
    receiving process cannot be configured and the channel is trusted.

    Example:
        >>> ref = StreamRef.of(stream)          # doctest: +SKIP
        >>> same = pickle.loads(pickle.dumps(ref)).open()   # doctest: +SKIP
    """

    catalog_name: str
    catalog_properties: tuple[tuple[str, str], ...]
    identifier: str
    secrets: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    ship_secrets: bool = False
    withheld: tuple[str, ...] = field(default=(), compare=False)  # the names of the secrets a pickle left behind

    @classmethod
    def of(cls, stream: StreamTable, *, include_secrets: bool = False) -> StreamRef:
        """The address of ``stream``; ``include_secrets=True`` makes its pickles carry the credentials (see above)."""
        catalog = stream.table.catalog
        props = travelling_properties(catalog.properties)
        if "type" not in props and PY_CATALOG_IMPL not in props:
            props[PY_CATALOG_IMPL] = f"{type(catalog).__module__}.{type(catalog).__qualname__}"
        public, secret = split_secrets(props)
        return cls(catalog.name, tuple(sorted(public.items())), stream.name, tuple(sorted(secret.items())),
                   bool(include_secrets))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle without ``secrets`` unless they are shipped on purpose (``include_secrets=True``)."""
        withheld = tuple(sorted({*self.withheld, *(() if self.ship_secrets else (k for k, _ in self.secrets))}))
        return (type(self), (self.catalog_name, self.catalog_properties, self.identifier,
                             self.secrets if self.ship_secrets else (), self.ship_secrets, withheld))

    def __repr__(self) -> str:
        shown = redacted(dict(self.catalog_properties))
        held = f", secrets={sorted(k for k, _ in self.secrets)} (values hidden)" if self.secrets else ""
        return f"StreamRef({self.catalog_name!r}, {self.identifier!r}, properties={shown}{held})"

    def catalog(self) -> Catalog:
        """The catalog, loaded with these properties plus what pyiceberg's configuration gives this catalog name.

        Raises:
            ConfigError: The catalog cannot be built here; when a setting the pickle withheld (a credential) is not
                configured in this process either, the message names it and where to set it.
        """
        try:
            return self._catalog()
        except Exception as exc:
            missing = self._withheld_here()
            if not missing and isinstance(exc, LakestreamError):
                raise
            if not missing and transient(exc):  # a catalog busy or restarting: not a setting
                raise
            detail = redact(" ".join(str(exc).split()), dict(self.catalog_properties))[:400] or type(exc).__name__
            if missing:
                names = ", ".join(missing)
                envs = ", ".join(env_name(self.catalog_name, key) for key in missing)
                message = (f"could not load catalog {self.catalog_name!r} for stream {self.identifier} in this process: "
                           f"the pickled stream did not carry {names} (credentials stay out of pickles) and this "
                           f"process's configuration has none; set {envs} (or .pyiceberg.yaml under catalog: "
                           f"{self.catalog_name}:) where the stream is unpickled, or, over a trusted channel only, "
                           f"ship them with LakestreamDataset(..., ship_credentials=True) / StreamRef.of(stream, "
                           f"include_secrets=True). Cause: {detail}")
            else:
                message = (f"could not load catalog {self.catalog_name!r} for stream {self.identifier} in this process: "
                           f"{detail} ({type(exc).__name__}); configure it in .pyiceberg.yaml under catalog: "
                           f"{self.catalog_name}: or with {env_name(self.catalog_name, 'uri')} and friends")
            error = ConfigError(redact(message, dict(self.catalog_properties)))
            error.original = exc  # type: ignore[attr-defined]  # not chained: its text is unredacted
            raise error from None

    def _own_key_ids(self) -> list[str]:
        """The carried key ids (``s3.access-key-id``, ``client.access-key-id``) whose secret the pickle withheld and
        this process's configuration gives a key id of its own for: a key id and its secret are one credential, so
        both come from this process's configuration (carried settings otherwise win over it)."""
        withheld = [key for key in self.withheld if key not in dict(self.secrets)]
        if not withheld:
            return []
        try:
            configured = Config().get_catalog_config(self.catalog_name) or {}
        except Exception:  # noqa: BLE001 - a malformed configuration: load_catalog says so
            return []
        carried = dict(self.catalog_properties)
        ids = {key.rsplit(".", 1)[0] + ".access-key-id" for key in withheld if "." in key}
        # pyiceberg's S3 FileIO takes s3.* first, then client.* (one AWS key pair for catalog and storage): a worker's own
        # client.* pair must not be paired with the parent's carried s3.access-key-id either
        own_aws = any(configured.get(key) for key in _AWS_KEY_IDS)
        return sorted(key for key in ids if key in carried and (
            (configured.get(key) and configured[key] != carried[key])
            or (key in _AWS_KEY_IDS and own_aws and not configured.get(key))))

    def _withheld_here(self) -> list[str]:
        """The withheld settings this process's configuration does not give the catalog either."""
        if not self.withheld:
            return []
        try:
            configured = Config().get_catalog_config(self.catalog_name) or {}
        except Exception:  # noqa: BLE001 - a malformed configuration: every withheld setting is missing
            configured = {}
        have = {**configured, **dict(self.secrets)}
        # a worker with an AWS key pair of its own needs none of the parent's AWS credentials (its session token neither)
        own_pair = any(have.get(key) for key in _AWS_KEY_IDS) and any(have.get(key) for key in _AWS_SECRETS)
        return [key for key in self.withheld if not have.get(key) and not have.get(key.replace("_", "-"))
                and not (own_pair and key.split(".", 1)[0] in ("s3", "client"))]

    def _catalog(self) -> Catalog:
        props = {**dict(self.catalog_properties), **dict(self.secrets)}
        for key in self._own_key_ids():
            props.pop(key)  # this process's own key pair: its key id with its secret, never the parent's id with it
        impl = props.pop(PY_CATALOG_IMPL, None)
        if impl is None:
            return load_catalog(self.catalog_name, **props)  # pyiceberg merges .pyiceberg.yaml and PYICEBERG_* itself
        # pyiceberg's load_catalog ignores the configuration when given py-catalog-impl: merge it here, the same way
        configured: dict[str, Any] = {k: v for k, v in (Config().get_catalog_config(self.catalog_name) or {}).items()
                                      if isinstance(v, str) and k not in ("type", PY_CATALOG_IMPL)}
        given, dashed = resolve(self.catalog_name, configured, props)  # POOL_PRE_PING=true means pool_pre_ping here too
        configured = {k: v for k, v in configured.items() if k not in dashed}
        module, _, name = impl.rpartition(".")
        catalog_class = getattr(importlib.import_module(module), name)
        with config_errors(configured | given, action=f"loading catalog {self.catalog_name!r}", catalog=self.catalog_name):
            return catalog_class(self.catalog_name, **merge_config(configured, given))

    def open(self) -> StreamTable:
        catalog = self.catalog()
        fork_safe(catalog)  # a reader's forked workers open their own catalog connections (connect/fork.py)
        with config_errors(catalog.properties, action=f"opening stream {self.identifier}", catalog=catalog.name):
            try:
                table = catalog.load_table(self.identifier)
            except MALFORMED as exc:
                if not unparsable(exc):  # an HTTP client's JSONDecodeError (a REST token refresh): not a metadata file
                    raise
                raise malformed_metadata(f"the current metadata file of table {self.identifier}", exc) from exc
            return StreamTable(table)


def forked_view(stream: StreamTable) -> StreamTable | None:
    """A forked process's own view of ``stream``, which its parent opened, made without asking the catalog: the
    parent's table metadata (as new as when the parent last read it: a follower's first poll brings it to the head),
    a FileIO of its own (the parent's holds its storage clients' connections), and the parent's catalog when that is a
    SQL catalog whose engine the fork started over (:func:`~lakestream_iceberg.connect.fork.fork_safe`): it opens a
    connection of its own on first use only, so a DataLoader worker that follows through another process's head relay
    never opens one. None otherwise (other catalogs hold an HTTP session of the parent's): reopen with
    :meth:`StreamRef.open`.
    """
    table = stream.table
    catalog = table.catalog
    if not owns_connections(catalog):
        return None
    io = catalog._load_file_io(table.metadata.properties, table.metadata_location)  # what load_table gives a table
    return StreamTable(Table(table.name(), table.metadata, table.metadata_location, io, catalog))
