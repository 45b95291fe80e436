"""Make pyiceberg's SigV4-signed REST requests carry ``x-amz-content-sha256``.

Why: pyiceberg's REST client (``RestCatalog._init_sigv4`` -> ``SigV4Adapter.add_headers``; seen in 0.12.0 and the
earlier releases with ``rest.sigv4-enabled``) signs bodies with botocore's plain ``SigV4Auth``, which hashes the body
into the signature but never sends the hash; pyiceberg adds the header only for *empty* bodies. S3-style verifiers
such as SeaweedFS's Iceberg REST catalog read the payload hash from that header, so every POST with a body
(``create_namespace``, ``create_table``, commits) gets 403 "signature does not match".

Fix: after pyiceberg mounts its adapter, wrap that adapter's ``add_headers`` so a request with a body first gets
``x-amz-content-sha256`` = hex SHA-256 of the body, which is then signed with the other headers. Nothing else changes.
It is installed only if a dry run of pyiceberg's own adapter (no network) shows the header missing, so it switches
itself off on a pyiceberg that sends it (upstream: apache/iceberg-python PR #3120). To remove: once pyiceberg is
pinned to such a release (``rest_sigv4_fix_active()`` is False after install), delete this module and its calls.
"""

from __future__ import annotations

import hashlib
import types
import warnings
from typing import Any

_MARK = "_lakestream_sha256_fix"
_HEADER = "x-amz-content-sha256"


def _needs_fix(init_sigv4: Any) -> bool:
    """Run pyiceberg's SigV4 adapter on a POST with a body and see whether it sends the hash."""
    import requests

    session = requests.Session()
    fake = types.SimpleNamespace(
        uri="http://sigv4-probe.invalid",
        properties={"client.access-key-id": "probe", "client.secret-access-key": "probe", "client.region": "us-east-1"},
    )
    init_sigv4(fake, session)
    request = requests.Request("POST", "http://sigv4-probe.invalid/v1/namespaces", json={"namespace": ["probe"]})
    prepared = session.prepare_request(request)
    adapter: Any = session.get_adapter(fake.uri)
    adapter.add_headers(prepared)
    return _HEADER not in prepared.headers


def rest_sigv4_fix_active() -> bool:
    """True once ``install_rest_sigv4_fix()`` has patched pyiceberg in this process."""
    from pyiceberg.catalog.rest import RestCatalog

    return bool(getattr(RestCatalog._init_sigv4, _MARK, False))


def install_rest_sigv4_fix() -> None:
    """Patch pyiceberg's REST SigV4 signing if this pyiceberg needs it; safe to call repeatedly."""
    from pyiceberg.catalog.rest import RestCatalog

    original = RestCatalog._init_sigv4
    if getattr(original, _MARK, False):
        return
    try:
        if not _needs_fix(original):
            return
    except Exception as exc:  # pyiceberg's internals moved: do not patch what we cannot check
        warnings.warn(f"rest_sigv4: not patching pyiceberg, probe failed: {exc!r}", RuntimeWarning, stacklevel=2)
        return

    def _init_sigv4(self: Any, session: Any) -> None:
        original(self, session)
        adapter = session.get_adapter(self.uri)
        sign = adapter.add_headers

        def add_headers(request: Any, **kwargs: Any) -> None:
            body = request.body
            if body and _HEADER not in request.headers and isinstance(body, (bytes, str)):
                data = body.encode("utf-8") if isinstance(body, str) else body
                request.headers[_HEADER] = hashlib.sha256(data).hexdigest()
            sign(request, **kwargs)

        adapter.add_headers = add_headers

    setattr(_init_sigv4, _MARK, True)
    _init_sigv4.__wrapped__ = original  # type: ignore[attr-defined]
    RestCatalog._init_sigv4 = _init_sigv4  # type: ignore[method-assign]
