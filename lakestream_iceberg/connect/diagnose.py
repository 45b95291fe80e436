"""Connection and credential failures, told apart and explained: which setting to fix, never its secret value.

pyiceberg, pyarrow, botocore, requests and SQLAlchemy each report a wrong secret or an unreachable server in their own
words (``OSError: ... AWS Error ACCESS_DENIED during HeadObject``, ``ForbiddenError: ... signature ... does not
match``, ``OperationalError: ... Connection refused``). This module maps them to one :class:`ConfigError` whose
message names the catalog property to fix (``s3.secret-access-key``, ``s3.endpoint``, ``uri``,
``client.secret-access-key``, ...) and the equivalent ``PYICEBERG_CATALOG__<NAME>__...`` variable, and it tells
*transient* failures (a server restarting: retry with bounded backoff) from permanent ones (a wrong secret: fail now).

* :func:`explain` -- the :class:`ConfigError` for an exception, or ``None`` when it is not a connection/credential
  failure;
* :func:`config_errors` -- a context manager applying :func:`explain` to whatever its block raises;
* :func:`load_catalog` -- ``pyiceberg.catalog.load_catalog`` with :func:`explain` applied (REST catalogs connect
  when loaded), each setting given the same meaning in the file, a variable or an argument
  (:mod:`lakestream_iceberg.connect.catalog_settings`);
* :func:`transient` -- whether a failure is worth retrying (:mod:`lakestream_iceberg.connect.retry` retries it);
* :func:`redact` -- removes every secret value of a property dict (and URI passwords) from a text (it lives in
  :mod:`lakestream_iceberg.connect.secrets`, with the rule of which properties are secret).

Secrets never reach a message: the whole message (the original exception's text, and the endpoint or URI it quotes
from the properties) is redacted, and the original exception is kept as ``error.original`` instead of being chained
(a chained traceback would print it unredacted).

Example:
    >>> with config_errors(catalog.properties, action="creating stream demo.run"):   # doctest: +SKIP
    ...     Stream.create(catalog, "demo.run", schema=schema, world_size=2)
    ConfigError: creating stream demo.run: the S3 server refused the credentials (AWS Error ACCESS_DENIED ...);
    check s3.access-key-id and s3.secret-access-key (...)
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from lakestream_iceberg.connect.catalog_settings import check_env_reaches, check_spelling, env_name, misspelt_keys, resolve
from lakestream_iceberg.connect.secrets import redact, secret_values
from lakestream_iceberg.errors import ConfigError, LakestreamError

__all__ = ["config_errors", "explain", "load_catalog", "one_line", "redact", "secret_values", "transient"]



# --------------------------------------------------------------------------------------------------- classification


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters (an AWS error's text runs long), for a message."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(exc: BaseException) -> str:
    return " ".join(f"{type(e).__module__}.{type(e).__name__}: {e}" for e in _chain(exc))


def _kind(exc: BaseException) -> str | None:
    """Which component failed: ``s3`` (object storage), ``sql`` (SQL catalog database), ``rest`` (REST catalog)."""
    for e in _chain(exc):
        module = type(e).__module__
        if module.startswith(("sqlalchemy", "psycopg", "pg8000", "sqlite3")):
            return "sql"
        if module.startswith(("requests", "urllib3")) or (module.startswith("pyiceberg.exceptions") and _is_rest_error(e)):
            return "rest"
        if module.startswith(("botocore", "aiobotocore", "s3fs")):
            return "s3"
        if isinstance(e, OSError) and "AWS Error" in str(e):
            return "s3"
    return None


def _is_rest_error(e: BaseException) -> bool:
    return type(e).__name__ in {"ForbiddenError", "UnauthorizedError", "ServerError", "ServiceUnavailableError",
                                "AuthorizationExpiredError", "OAuthError", "RESTError", "BadRequestError",
                                "TooManyRequestsError"}  # fmt: skip


_S3_AUTH = re.compile(r"ACCESS_DENIED|SIGNATURE_DOES_NOT_MATCH|INVALID_ACCESS_KEY_ID|SignatureDoesNotMatch|"
                      r"InvalidAccessKeyId|AccessDenied|InvalidToken|ExpiredToken|NoCredentials|Unable to locate credentials|"
                      r"HTTP status 403|HTTP status 401|"
                      # botocore's text for a response without a body (a HEAD: s3fs's PermissionError('Forbidden'))
                      r"An error occurred \((?:401|403)\) when calling")  # fmt: skip
_S3_SECRET = re.compile(r"SIGNATURE_DOES_NOT_MATCH|SignatureDoesNotMatch")
_S3_KEY_ID = re.compile(r"INVALID_ACCESS_KEY_ID|InvalidAccessKeyId")
_S3_UNREACHABLE = re.compile(r"NETWORK_CONNECTION|curlCode: (?:6|7|28|35|52|55|56)\b|Could not connect|Could not resolve|"
                             r"EndpointConnectionError|ConnectTimeoutError|ReadTimeoutError|Connect timeout|"
                             r"Connection (?:refused|reset)|timed out|Timeout was reached")  # fmt: skip
_S3_TIMEOUT = re.compile(r"curlCode: 28|Timeout was reached|timed out|ConnectTimeoutError|ReadTimeoutError")
_S3_SERVER = re.compile(r"SERVICE_UNAVAILABLE|SLOW_DOWN|INTERNAL_FAILURE|THROTTLING|REQUEST_TIMEOUT|HTTP status (?:5\d\d|429)\b|"
                        r"InternalError|ServiceUnavailable|SlowDown|RequestTimeout|"
                        # botocore's text for a response without a body (a HEAD through s3fs: OSError 'Service Unavailable')
                        r"An error occurred \((?:5\d\d|429)\) when calling")  # fmt: skip
# pyarrow's S3FileSystem given a key id without its secret (or a secret without its id): a ValueError before any request
_S3_HALF_KEY = re.compile(r"both access_key and secret_key must be provided")
_S3_BUCKET = re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist")
# the endpoint's TLS certificate is refused (untrusted, expired, for another name): every retry meets the same one
_S3_TLS = re.compile(r"curlCode: (?:51|58|60|77|83|90)\b|SSL peer certificate|certificate verify failed")
_SQL_AUTH = re.compile(r"password authentication failed|no password supplied|authentication failed|"
                       r"role \"[^\"]*\" does not exist|pg_hba\.conf", re.I)  # fmt: skip
_SQL_UNREACHABLE = re.compile(r"Connection refused|could not connect|could not translate host name|timeout expired|"
                              r"server closed the connection|terminating connection|Is the server running|"
                              r"the database system is (?:starting up|shutting down|in recovery mode)|"
                              r"connection to server .* failed|SSL connection has been closed|unable to open database file",
                              re.I)  # fmt: skip
_SQL_DATABASE = re.compile(r"database \"[^\"]*\" does not exist", re.I)
# PostgreSQL's "cannot execute UPDATE in a read-only transaction" (SQLSTATE 25006): during a failover a pooled
# connection can reach the old primary, now a standby, until it is replaced; a role without the privilege is refused
# with "permission denied" instead
_SQL_FAILOVER = re.compile(r"read-only transaction", re.I)
# SQLite reports these as OperationalError too, as it does a locked database: a retry cannot change them
_SQL_PERMANENT = re.compile(r"readonly database|no such (?:table|column|function)|has no column named|syntax error",
                            re.I)  # fmt: skip


_REST_RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})  # request timeout, throttled, a gateway or server restarting


def _http_statuses(exc: BaseException) -> set[int]:
    """The HTTP status codes of the responses in ``exc``'s chain (a ``requests.HTTPError`` carries its response)."""
    found = set()
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int) and not isinstance(status, bool):
            found.add(status)
    return found


def transient(exc: BaseException) -> bool:
    """True for failures worth retrying: a server unreachable, restarting or overloaded (not a wrong secret,
    not a missing file or bucket)."""
    if isinstance(exc, LakestreamError) or isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    text = _text(exc)
    kind = _kind(exc)
    if kind == "s3" or (isinstance(exc, OSError) and "AWS Error" in text):
        if _S3_AUTH.search(text) or _S3_BUCKET.search(text) or _S3_TLS.search(text):
            return False
        return bool(_S3_UNREACHABLE.search(text) or _S3_SERVER.search(text))
    if kind == "sql":
        if _SQL_AUTH.search(text) or _SQL_DATABASE.search(text) or _SQL_PERMANENT.search(text):
            return False
        if _SQL_FAILOVER.search(text):
            return True
        # by class and base classes: a driver's own error (psycopg2's QueryCanceled, DeadlockDetected on a direct
        # connection, connect/direct.py) counts as the OperationalError SQLAlchemy would have wrapped it in
        names = {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}
        # TimeoutError: SQLAlchemy's pool had no free connection in time (the process's other threads held them all)
        return bool(names & {"OperationalError", "InterfaceError", "DisconnectionError", "TimeoutError"}) \
            or bool(_SQL_UNREACHABLE.search(text))
    if kind == "rest":
        names = {type(e).__name__ for e in _chain(exc)}
        return bool(names & {"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "ServerError",
                             "ServiceUnavailableError", "ChunkedEncodingError", "ProtocolError",
                             "TooManyRequestsError"}) or bool(_http_statuses(exc) & _REST_RETRY_STATUSES)  # fmt: skip
    return isinstance(exc, (ConnectionError, TimeoutError))


# --------------------------------------------------------------------------------------------------- explanation


def _settings(keys: list[str], catalog: str | None) -> str:
    named = " and ".join(keys)
    envs = ", ".join(env_name(catalog, k) for k in keys)
    return f"check {named} in .pyiceberg.yaml (or {envs})"


def explain(
    exc: BaseException,
    properties: Mapping[str, Any] | None = None,
    *,
    action: str | None = None,
    catalog: str | None = None,
) -> ConfigError | None:
    """The :class:`ConfigError` for a connection or credential failure, naming the setting; ``None`` otherwise.

    Args:
        exc: What pyiceberg / pyarrow / botocore / requests / SQLAlchemy raised.
        properties: The catalog (or FileIO) properties in use: endpoints are quoted from them, secrets redacted.
        action: What was being done ("opening stream demo.run"), the message's prefix.
        catalog: The catalog name, for the ``PYICEBERG_CATALOG__<NAME>__...`` hint.
    """
    if isinstance(exc, LakestreamError):
        return None
    props = dict(properties or {})
    kind = _kind(exc)
    text = _text(exc)
    prefix = f"{action}: " if action else ""
    detail = redact(" ".join(str(exc).split()) or type(exc).__name__, props)
    if len(detail) > 400:
        detail = detail[:400] + " ..."
    message: str | None = None

    if _S3_HALF_KEY.search(text):
        typos = misspelt_keys(props)
        hint = "".join(f"; {key} is not a setting pyiceberg reads: did you mean {meant}?" for key, meant in sorted(typos.items()))
        message = ("s3.access-key-id and s3.secret-access-key go together, and only one of them is set"
                   f"{hint}; " + _settings(["s3.access-key-id", "s3.secret-access-key"], catalog)
                   + " (or set neither, for the AWS credential chain)")  # fmt: skip
    elif kind == "s3":
        endpoint = props.get("s3.endpoint") or "the default AWS endpoint"
        if _S3_SECRET.search(text):
            message = ("the S3 server rejected the request signature: the secret key is wrong; "
                       + _settings(["s3.secret-access-key"], catalog))  # fmt: skip
        elif _S3_KEY_ID.search(text):
            message = "the S3 server does not know the access key id; " + _settings(["s3.access-key-id"], catalog)
        elif _S3_AUTH.search(text):
            message = ("the S3 server refused the credentials (wrong or missing key, or no permission on the bucket); "
                       + _settings(["s3.access-key-id", "s3.secret-access-key"], catalog))  # fmt: skip
        elif _S3_BUCKET.search(text):
            message = "the S3 bucket does not exist; " + _settings(["warehouse"], catalog) + " (or the table location)"
        elif _S3_TIMEOUT.search(text):
            message = (f"the S3 endpoint {endpoint} did not answer in time; "
                       + _settings(["s3.endpoint"], catalog)
                       + " (each attempt is bounded by s3.connect-timeout and s3.request-timeout, in seconds)")  # fmt: skip
        elif _S3_UNREACHABLE.search(text):
            message = f"cannot connect to the S3 endpoint {endpoint}; " + _settings(["s3.endpoint"], catalog)
    elif kind == "sql":
        uri = str(props.get("uri", "")) or "(no uri set)"
        if _SQL_AUTH.search(text):
            message = (
                f"the catalog database {uri} refused the login; check the user and password in uri "
                f"(or {env_name(catalog, 'uri')}; prefer a password file / PGPASSWORD over a password in the uri)"
            )
        elif _SQL_DATABASE.search(text):
            message = f"the catalog database in {uri} does not exist; create it or " + _settings(["uri"], catalog)
        elif "timeout expired" in text or "timed out" in text:
            message = (f"the catalog database {uri} did not answer in time; " + _settings(["uri"], catalog)
                       + " (bound the wait with ?connect_timeout=SECONDS in the uri)")  # fmt: skip
        elif _SQL_UNREACHABLE.search(text):
            message = f"cannot connect to the catalog database {uri}; " + _settings(["uri"], catalog)
    elif kind == "rest":
        uri = props.get("uri") or "(no uri set)"
        names = {type(e).__name__ for e in _chain(exc)}
        sigv4 = str(props.get("rest.sigv4-enabled", "")).lower() == "true"
        if "ForbiddenError" in names or "UnauthorizedError" in names or "AuthorizationExpiredError" in names:
            if "access key id you provided does not exist" in text.lower() or "InvalidAccessKeyId" in text:
                message = "the REST catalog does not know the access key id; " + _settings(["client.access-key-id"], catalog)
            elif "signature" in text.lower() or (sigv4 and "ForbiddenError" not in names):
                message = ("the REST catalog rejected the request signature; "
                           + _settings(["client.access-key-id", "client.secret-access-key"], catalog)
                           + " (and rest.signing-region / rest.signing-name)")  # fmt: skip
            elif "ForbiddenError" in names:  # 403: the principal is known, and may lack a permission on this table
                message = ("the REST catalog refused this request (403 Forbidden): the principal of these credentials "
                           "may lack a permission on this table (its grants are the catalog admin's), or they are not "
                           "the ones meant; "
                           + _settings(["client.access-key-id", "client.secret-access-key"] if sigv4
                                       else ["credential", "token"], catalog))  # fmt: skip
            else:
                message = ("the REST catalog refused the credentials; "
                           + _settings(["credential", "token"], catalog) + " (or enable rest.sigv4-enabled)")  # fmt: skip
        elif names & {"ConnectTimeout", "ReadTimeout", "Timeout"}:
            message = f"the REST catalog {uri} did not answer in time; " + _settings(["uri"], catalog)
        elif names & {"ConnectionError", "NewConnectionError", "MaxRetryError"}:
            message = f"cannot connect to the REST catalog {uri}; " + _settings(["uri"], catalog)
    if message is None:
        return None
    error = ConfigError(redact(f"{prefix}{message}. Cause: {detail}", props))
    error.original = exc  # type: ignore[attr-defined]  # kept for debugging; not chained (its text is unredacted)
    return error


@contextlib.contextmanager
def config_errors(
    properties: Mapping[str, Any] | None = None, *, action: str | None = None, catalog: str | None = None
) -> Iterator[None]:
    """Raise :func:`explain`'s :class:`ConfigError` for a connection/credential failure in the block; other
    exceptions pass through unchanged."""
    try:
        yield
    except Exception as exc:
        error = explain(exc, properties, action=action, catalog=catalog)
        if error is None:
            raise
        raise error from None


PASS_SETTINGS = ", or pass its settings (type=, uri=, warehouse=, ...) to load_catalog"  # the command line says its own


def load_catalog(name: str | None = None, **properties: str) -> Any:
    """``pyiceberg.catalog.load_catalog`` that raises a :class:`ConfigError` naming the setting on connection or
    credential failures (SQL catalogs connect when loaded, REST catalogs fetch their config).

    A setting means the same in ``.pyiceberg.yaml``, as a ``PYICEBERG_CATALOG__<NAME>__<KEY>`` variable and as a
    keyword argument: ``PYICEBERG_CATALOG__PROD__POOL_PRE_PING=true``, which pyiceberg reads as ``pool-pre-ping``,
    sets ``pool_pre_ping`` as ``pool_pre_ping="true"`` does (:mod:`lakestream_iceberg.connect.catalog_settings`).
    A ``type`` that names no catalog type, or a SQLAlchemy engine option pyiceberg's SQL catalog would ignore
    (``pool_size``, ``pool_recycle``, ...), raises a :class:`ConfigError`. The file and the variables are read as they
    are at the call (pyiceberg alone uses what it read at import, dropping a variable set since).

    It also installs the two REST client fixes pyiceberg 0.12 needs for SigV4 object-store catalogs (the
    ``x-amz-content-sha256`` header, see :mod:`lakestream_iceberg.connect.rest_sigv4`, and request timeouts, see
    :mod:`lakestream_iceberg.connect.rest_timeout`); both are idempotent and off where pyiceberg does not need them.

    Args:
        name: The catalog's name in ``.pyiceberg.yaml`` / ``PYICEBERG_CATALOG__<NAME>__*``. ``None`` (the default)
            takes pyiceberg's default catalog: the configuration's ``default-catalog`` (``PYICEBERG_DEFAULT_CATALOG``),
            else ``default``, as ``pyiceberg.catalog.load_catalog()`` does.
        **properties: Catalog properties that override the configured ones (``type``, ``uri``, ``warehouse``, ...).

    Returns:
        The pyiceberg ``Catalog``.

    Raises:
        ConfigError: The catalog is not configured, a setting is wrong or unknown, or connecting or authenticating
            failed (the message names the setting and its variable, never a secret's value).

    Example:
        >>> from lakestream_iceberg import load_catalog
        >>> catalog = load_catalog("prod")  # .pyiceberg.yaml / PYICEBERG_CATALOG__PROD__* as usual  # doctest: +SKIP
    """
    from pyiceberg.catalog import load_catalog as _load

    unnamed = name is None
    if name is None:
        name = _default_name()
    if not isinstance(name, str):  # pyiceberg: "argument of type 'int' is not iterable"
        raise ConfigError(f"a catalog's name is a string (its name in .pyiceberg.yaml / PYICEBERG_CATALOG__<NAME>__*), "
                          f"got {type(name).__name__} {name!r}"[:300])

    from lakestream_iceberg.connect.rest_sigv4 import install_rest_sigv4_fix
    from lakestream_iceberg.connect.rest_timeout import install_rest_timeout

    if _may_be_rest(name, properties):  # the fixes import botocore (~0.3 s per process): not for SQL catalogs
        install_rest_sigv4_fix()
        install_rest_timeout()

    check_env_reaches(name, os.environ)  # PYICEBERG_CATALOG__MY_CAT__* configures my-cat, not my_cat
    configured = _configured(name) or {}
    check_spelling(name, {**configured, **properties})  # S3_SECRET_ACCESS_KEY (one _ short): dropped by pyiceberg
    given, dashed = resolve(name, configured, properties)
    # pyiceberg merges the configuration it read at import: a variable set (or a file changed) since then was dropped
    # without a word and the file's catalog used, and one unset since was still used; it gets the configuration as it
    # is now, the call's own arguments still winning
    _install_current_config()
    # the messages quote the settings pyiceberg used (config file and environment too), e.g. the uri it could not reach
    used = _merged(name, given) or given
    try:
        with config_errors(used, action=f"loading catalog {name!r}", catalog=name):
            catalog = _load(name, **given)
    except LakestreamError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyiceberg says "not configured" or a wrong setting with ValueError, its
        # own exceptions, SQLAlchemy's and botocore's: "URI missing", "Could not infer the catalog type", no region
        if transient(exc):  # a catalog busy or restarting (a REST 503 / 429, a locked database): not a setting, retry
            raise
        cause = exc.__cause__  # pyiceberg's "SQLAlchemy support not installed" for a uri whose driver is missing
        text = f"{exc} ({cause})" if isinstance(cause, ImportError) else str(exc)
        detail = redact(" ".join(text.split()), used) or type(exc).__name__
        if len(detail) > 400:
            detail = detail[:400] + " ..."
        which = (" (no name was given: pyiceberg's default catalog is the one default-catalog or "
                 "PYICEBERG_DEFAULT_CATALOG names, else 'default')") if unnamed else ""
        error = ConfigError(f"could not load catalog {name!r}{which}: {detail} ({type(exc).__name__}); configure it in "
                            f".pyiceberg.yaml under catalog: {name}: or with {env_name(name, 'uri')} and friends"
                            + PASS_SETTINGS)
        error.original = exc  # type: ignore[attr-defined]  # not chained: its text is unredacted
        raise error from None
    if isinstance(getattr(catalog, "properties", None), dict):  # pyiceberg merged them back in from its config
        for key in dashed:
            catalog.properties.pop(key, None)
    return catalog


def _default_name() -> str:
    """pyiceberg's default catalog name in the configuration as it is now: ``default-catalog`` (in
    ``.pyiceberg.yaml`` or ``PYICEBERG_DEFAULT_CATALOG``), else ``default``."""
    from lakestream_iceberg.connect.config_file import check_config_file

    check_config_file()
    try:
        from pyiceberg.utils.config import Config

        config = Config()
    except Exception:  # noqa: BLE001 - its config helpers moved: pyiceberg's own lookup at load time decides
        return "default"
    given = config.config.get("default-catalog")
    if given is not None and not isinstance(given, str):  # pyiceberg: ValueError "should be a str"
        raise ConfigError(f"the configuration's default-catalog (.pyiceberg.yaml or PYICEBERG_DEFAULT_CATALOG) is "
                          f"{type(given).__name__} {given!r}"[:200] + ": set it to a catalog's name, or pass the name "
                          "to load_catalog")
    return given or "default"


def _configured(name: str) -> dict[str, Any] | None:
    """What pyiceberg's configuration (``.pyiceberg.yaml`` and ``PYICEBERG_*``, as they are now) holds for the catalog
    ``name`` (None when its config helpers moved)."""
    from lakestream_iceberg.connect.config_file import check_config_file

    check_config_file()  # a file edited since import into one pyiceberg cannot parse: one ConfigError naming it
    try:
        from pyiceberg.utils.config import Config

        return dict(Config().get_catalog_config(name) or {})
    except Exception:  # noqa: BLE001 - its config helpers moved, or an entry that is no mapping (pyiceberg says so)
        return None


def _install_current_config() -> None:
    """Give pyiceberg the configuration (``.pyiceberg.yaml`` and ``PYICEBERG_*``) as it is now, in place of what it read
    at import (kept where its config helpers moved or the configuration cannot be read)."""
    try:
        import pyiceberg.catalog
        from pyiceberg.utils.config import Config

        pyiceberg.catalog._ENV_CONFIG = Config()  # type: ignore[attr-defined]  # noqa: SLF001
    except Exception:  # noqa: BLE001 - its config helpers moved, or an entry that is no mapping (pyiceberg says so)
        pass


def _merged(name: str, properties: Mapping[str, Any]) -> dict[str, Any] | None:
    """The catalog's settings as pyiceberg's ``load_catalog`` merges them (None when its config helpers moved)."""
    try:
        from pyiceberg.utils.config import merge_config

        configured = _configured(name)
        return None if configured is None else merge_config(configured, dict(properties))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001
        return None


def _may_be_rest(name: str, properties: dict[str, str]) -> bool:
    """Whether pyiceberg's ``load_catalog`` could make a REST catalog of this name and these properties (its own
    rule: ``type``, else the URI's scheme, over the config file and environment); True when in doubt."""
    conf = _merged(name, properties)  # the config load_catalog itself reads (captured at import)
    if conf is None:
        return True
    try:
        kind, uri = conf.get("type"), conf.get("uri")
        if conf.get("py-catalog-impl"):
            return True
        if isinstance(kind, str) and kind:
            return kind.lower() == "rest"
        return not (isinstance(uri, str) and uri.startswith(("sqlite", "postgresql", "thrift")))
    except Exception:  # noqa: BLE001 - pyiceberg's config helpers moved: install the fixes as before
        return True
