"""Give pyiceberg's REST client timeouts: a REST catalog that accepts connections and never answers must not hang.

Why: pyiceberg 0.12's ``RestCatalog`` sends every request (``_fetch_config`` at load time included) through a
``requests.Session`` without a ``timeout``, so a hung server or a black-holed address blocks forever.

Fix: wrap ``RestCatalog._create_session`` so each session's ``request`` gets ``timeout=(connect, read)`` unless the
caller passed one, read from the Java Iceberg property names ``rest.client.connection-timeout-ms`` (default 10 s) and
``rest.client.socket-timeout-ms`` (default 60 s). urllib3 may retry a timed-out GET (``rest.sigv4.max-retries``,
default 10, for SigV4 catalogs), so the worst case is ``(retries + 1) * (connect + read)``. A value that is not a
number of milliseconds from 1 to ``MAX_TIMEOUT_MS`` (one day) is refused with a :class:`ConfigError`.
"""

from __future__ import annotations

import math
from typing import Any

from lakestream_iceberg.errors import ConfigError

CONNECT_TIMEOUT_MS = "rest.client.connection-timeout-ms"
SOCKET_TIMEOUT_MS = "rest.client.socket-timeout-ms"
DEFAULT_CONNECT_S = 10.0
DEFAULT_READ_S = 60.0
MAX_TIMEOUT_MS = 86_400_000.0  # one day; sockets refuse timeouts past the platform's time_t
_MARK = "_lakestream_rest_timeout"


def _seconds(props: Any, key: str, default_s: float) -> float:
    """The property ``key`` (milliseconds) in seconds, ``default_s`` when unset.

    Raises:
        ConfigError: The value is not a number of milliseconds from 1 to ``MAX_TIMEOUT_MS``.
    """
    raw = props.get(key)
    if raw is None:
        return default_s
    try:
        ms = float(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else math.nan
    except ValueError:
        ms = math.nan
    if not 1 <= ms <= MAX_TIMEOUT_MS:  # NaN fails too
        raise ConfigError(f"catalog property {key}={raw!r} must be a number of milliseconds from 1 to "
                          f"{MAX_TIMEOUT_MS:.0f}; fix it in .pyiceberg.yaml, its PYICEBERG_CATALOG__<NAME>__ variable "
                          "or the load_catalog() argument")
    return ms / 1000


def install_rest_timeout() -> None:
    """Patch pyiceberg's REST sessions to time out; safe to call repeatedly."""
    from pyiceberg.catalog.rest import RestCatalog

    original = RestCatalog._create_session
    if getattr(original, _MARK, False):
        return

    def _create_session(self: Any) -> Any:
        session = original(self)
        props = self.properties
        timeout = (_seconds(props, CONNECT_TIMEOUT_MS, DEFAULT_CONNECT_S), _seconds(props, SOCKET_TIMEOUT_MS, DEFAULT_READ_S))
        request = session.request

        def request_with_timeout(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout
            return request(method, url, *args, **kwargs)

        # an instance attribute shadowing Session.request, with a signature that passes everything through
        session.request = request_with_timeout  # type: ignore[method-assign,assignment]
        return session

    setattr(_create_session, _MARK, True)
    _create_session.__wrapped__ = original  # type: ignore[attr-defined]
    RestCatalog._create_session = _create_session  # type: ignore[method-assign]
