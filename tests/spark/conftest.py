"""A Spark Connect server on 127.0.0.1 for the session (`bench.connect_server`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench import connect_server as server_module


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory) -> Iterator[server_module.ConnectServer]:
    with server_module.connect_server(str(tmp_path_factory.mktemp("connect"))) as server:
        yield server
