"""A password in a catalog URI's query string (``?password=...``, which libpq and SQLAlchemy accept as they accept
``user:password@``) is a secret like any other (connect/secrets.py): never in a message, a repr or a pickle."""

from __future__ import annotations

import pytest

from catalog import services
from lakestream_iceberg import ConfigError, load_catalog
from lakestream_iceberg.connect.secrets import has_uri_password, redact, redacted, split_secrets

CANARY = "Qx7canary9pw"


@pytest.mark.parametrize("query", [f"?password={CANARY}", f"?connect_timeout=2&password={CANARY}",
                                   f"?sslpassword={CANARY}&application_name=trainer"])
def test_a_password_in_the_uri_query_never_reaches_a_message_a_repr_or_a_pickle(query: str) -> None:
    uri = f"postgresql+psycopg2://trainer@127.0.0.1:{services.free_ports(1)[0]}/catalog{query}"
    with pytest.raises(ConfigError, match="cannot connect to the catalog database") as caught:
        load_catalog("querypw", type="sql", uri=uri)  # a real connection attempt to a closed port
    assert CANARY not in str(caught.value) and "trainer@127.0.0.1" in str(caught.value)
    assert has_uri_password(uri)
    assert CANARY not in str(redacted({"uri": uri})) and CANARY not in redact(f"at {uri}")
    shareable, secret = split_secrets({"uri": uri, "warehouse": "s3://bucket/wh"})
    assert secret == {"uri": uri} and shareable == {"warehouse": "s3://bucket/wh"}


def test_other_query_parameters_stay_readable() -> None:
    uri = "postgresql+psycopg2://trainer@db:5432/catalog?sslmode=require&connect_timeout=5"
    assert not has_uri_password(uri)
    assert redact(uri) == uri and redacted({"uri": uri}) == {"uri": uri}


def test_an_azure_connection_string_is_a_secret_whole_and_its_account_key_in_any_text() -> None:
    """pyiceberg's ``adls.connection-string`` carries the storage account key (``...;AccountKey=...;...``)."""
    key = "S3cr3tAccountKeyValue=="
    value = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={key};EndpointSuffix=core.windows.net"
    props = {"adls.connection-string": value, "adls.account-name": "acct"}
    shareable, secret = split_secrets(props)
    assert secret == {"adls.connection-string": value} and shareable == {"adls.account-name": "acct"}
    assert key not in str(redacted(props)) and key not in redact(f"cannot reach {value}", props)
    assert key not in redact(f"Server failed to authenticate: AccountName=acct;AccountKey={key}")  # no properties
