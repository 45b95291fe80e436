"""Which catalog properties are credentials, and the one way lakestream keeps them out of messages, reprs and pickles.

* :func:`is_secret_key` -- a property holds a secret when its key contains ``secret``, ``password``, ``token``,
  ``credential``, ``authorization``, ``api-key``, ``account-key``, ``private-key``, ``sas-`` or ``connection-string``,
  or ends in ``.key`` (``s3.secret-access-key``, ``client.session-token``, ``token``, ``credential``,
  ``header.Authorization``, ``adls.account-key``, ``adls.connection-string``, ``s3.sse.key``, ...). An access key *id* (``s3.access-key-id``, ``client.access-key-id``) is
  not a secret, by AWS's convention: it names the key, as a user name does;
* :func:`has_uri_password` -- a value such as ``postgresql://user:password@host/db`` (or ``...?password=...``) carries
  a secret too;
* :func:`split_secrets` -- properties as (shareable, secret): what a pickle may carry, what stays in the process;
* :func:`redacted` -- properties fit to print: secret values replaced, URI passwords replaced;
* :func:`redact` -- a text without any secret value of the given properties or of the environment, and without URI
  passwords; every lakestream message that quotes a property or a foreign error goes through it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "has_uri_password", "is_secret_key", "redact", "redact_uri", "redacted", "secret_values",
           "split_secrets"]

# A property whose key contains one of these (or ends in ".key") holds a secret. Its value is never quoted or pickled.
SECRET_KEY_PARTS = ("secret", "password", "token", "credential", "authorization", "api-key", "apikey", "account-key",
                    "accountkey", "private-key", "sas-", "connection-string")
SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PGPASSWORD")
REDACTED = "****"
# a password runs to the "@" (SQLAlchemy's rule: "/", "?", "#" may be in it, unescaped)
_URI_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@\s]+)@")
# a secret given as a URI query parameter (libpq and SQLAlchemy take ``?password=...``): a parameter named as a secret
# property would be (see is_secret_key)
_QUERY_PARAM = re.compile(r"(?P<lead>[?&;](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^&;#\s'\"]+)")


def is_secret_key(key: str) -> bool:
    """True when a property named ``key`` holds a credential (see the module docstring)."""
    lowered = key.lower()
    return any(part in lowered for part in SECRET_KEY_PARTS) or lowered.endswith(".key")


def _query_secrets(text: str) -> list[str]:
    """The values of the secret-named query parameters in ``text`` (``...?password=...``)."""
    return [m.group("value") for m in _QUERY_PARAM.finditer(text) if is_secret_key(m.group("name"))]


def has_uri_password(value: Any) -> bool:
    """True when ``value`` is a text containing a URI with a password (``scheme://user:password@host``, or a query
    parameter such as ``?password=...``)."""
    return isinstance(value, str) and (_URI_PASSWORD.search(value) is not None or bool(_query_secrets(value)))


def redact_uri(text: str) -> str:
    """``text`` with the password of every URI replaced (the user name stays: it helps to diagnose a login), and the
    value of every secret-named query parameter (``?password=...``)."""
    text = _URI_PASSWORD.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{REDACTED}@", text)
    return _QUERY_PARAM.sub(lambda m: f"{m.group('lead')}{REDACTED}" if is_secret_key(m.group("name")) else m.group(0),
                            text)


def split_secrets(properties: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(shareable, secret)``: the secret part holds every secret-named property and every value with a URI password."""
    shareable: dict[str, Any] = {}
    secret: dict[str, Any] = {}
    for key, value in properties.items():
        (secret if is_secret_key(key) or has_uri_password(value) else shareable)[key] = value
    return shareable, secret


def redacted(properties: Mapping[str, Any]) -> dict[str, Any]:
    """``properties`` fit to print: secret-named values are ``****``, URI passwords too."""
    return {k: REDACTED if is_secret_key(k) else redact_uri(v) if isinstance(v, str) else v for k, v in properties.items()}


def secret_values(properties: Mapping[str, Any] | None = None) -> list[str]:
    """Every secret value in ``properties`` and in the environment (catalog env vars included), longest first."""
    found: set[str] = set()
    for key, value in (properties or {}).items():
        if isinstance(value, str) and value and is_secret_key(key):
            found.add(value)
        if isinstance(value, str):
            found.update(m.group("password") for m in _URI_PASSWORD.finditer(value))
            found.update(_query_secrets(value))
    for key, value in os.environ.items():
        upper = key.upper()
        if value and (upper in SECRET_ENV_VARS or (upper.startswith("PYICEBERG_") and (any(
                part.replace("-", "_").upper() in upper for part in SECRET_KEY_PARTS) or upper.endswith("__KEY")))):  # fmt: skip
            found.add(value)
    return sorted((v for v in found if len(v) >= 3), key=len, reverse=True)


def redact(text: str, properties: Mapping[str, Any] | None = None) -> str:
    """``text`` without any secret value of ``properties`` (or the environment) and without URI passwords."""
    text = redact_uri(text)
    for value in secret_values(properties):
        text = text.replace(value, REDACTED)
    return text
