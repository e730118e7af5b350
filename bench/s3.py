"""A local S3 API for the benchmarks: moto on 127.0.0.1 (free port), throwaway keys.

The keys and endpoint travel as storage options (`open_storage(url, **s3.options)`), as
the product passes them; nothing is written into ``os.environ``. A child process that
takes credentials from its environment (the ``ckpt`` CLI) gets them in its own ``env``
(`MotoS3.child_env`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

KEY = SECRET = "bench"  # moto accepts any keys
REGION = "us-east-1"


@dataclass(frozen=True)
class MotoS3:
    endpoint: str
    options: dict[str, Any] = field(hash=False)  # storage options for `open_storage`

    def child_env(self) -> dict[str, str]:
        """The same credentials as the variables a child process's s3 client reads."""
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": REGION}


@contextmanager
def moto_s3(*buckets: str) -> Iterator[MotoS3]:
    """A started moto server with ``buckets`` created; stopped on exit."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        options = {"key": KEY, "secret": SECRET,
                   "client_kwargs": {"endpoint_url": endpoint}}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        for bucket in buckets:
            fs.mkdir(bucket)
        yield MotoS3(endpoint, options)
    finally:
        server.stop()
