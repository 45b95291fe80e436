"""REST request timeouts (connect/rest_timeout.py): a value that is no usable number of milliseconds is a ConfigError
naming the property when the catalog is loaded, not a ValueError or OverflowError from deep inside requests."""

from __future__ import annotations

import pytest

from catalog import services
from lakestream_iceberg import ConfigError, load_catalog
from lakestream_iceberg.connect.rest_timeout import CONNECT_TIMEOUT_MS, SOCKET_TIMEOUT_MS


@pytest.mark.parametrize("key", [CONNECT_TIMEOUT_MS, SOCKET_TIMEOUT_MS])
@pytest.mark.parametrize("value", ["abc", "", "nan", "0", "-5", "inf", "1e308"])
def test_a_timeout_that_is_no_usable_number_of_ms_is_a_config_error_naming_it(key: str, value: str) -> None:
    port = services.free_ports(1)[0]  # nothing listens: the refusal comes before any request
    with pytest.raises(ConfigError, match=f"{key}=") as caught:
        load_catalog("timeouts", type="rest", uri=f"http://127.0.0.1:{port}", **{key: value})
    assert "milliseconds" in str(caught.value)


def test_a_usable_timeout_goes_on_to_connect() -> None:
    port = services.free_ports(1)[0]
    with pytest.raises(ConfigError, match="cannot connect to the REST catalog"):
        load_catalog("timeouts", type="rest", uri=f"http://127.0.0.1:{port}",
                     **{CONNECT_TIMEOUT_MS: "2500", SOCKET_TIMEOUT_MS: "86400000"})
