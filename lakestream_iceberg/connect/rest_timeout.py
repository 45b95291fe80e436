"""Give pyiceberg's REST client timeouts: a REST catalog that accepts connections and never answers must not hang.

Why: pyiceberg 0.12's ``RestCatalog`` sends every request (``_fetch_config`` at load time included) through a
``requests.Session`` without a ``timeout``, so a hung server or a black-holed address blocks forever.

Fix: wrap ``RestCatalog._create_session`` so each session's ``request`` gets ``timeout=(connect, read)`` unless the
caller passed one, read from the Java Iceberg property names ``rest.client.connection-timeout-ms`` (default 10 s) and
``rest.client.socket-timeout-ms`` (default 60 s). urllib3 may retry a timed-out GET (``rest.sigv4.max-retries``,
default 10, for SigV4 catalogs), so the worst case is ``(retries + 1) * (connect + read)``.
"""

from __future__ import annotations

from typing import Any

CONNECT_TIMEOUT_MS = "rest.client.connection-timeout-ms"
SOCKET_TIMEOUT_MS = "rest.client.socket-timeout-ms"
DEFAULT_CONNECT_S = 10.0
DEFAULT_READ_S = 60.0
_MARK = "_lakestream_rest_timeout"


def install_rest_timeout() -> None:
    """Patch pyiceberg's REST sessions to time out; safe to call repeatedly."""
    from pyiceberg.catalog.rest import RestCatalog

    original = RestCatalog._create_session
    if getattr(original, _MARK, False):
        return

    def _create_session(self: Any) -> Any:
        session = original(self)
        props = self.properties
        timeout = (float(props.get(CONNECT_TIMEOUT_MS, DEFAULT_CONNECT_S * 1000)) / 1000,
                   float(props.get(SOCKET_TIMEOUT_MS, DEFAULT_READ_S * 1000)) / 1000)  # fmt: skip
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
