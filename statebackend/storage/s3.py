"""``s3://`` (and ``s3a://``) storage over s3fs.

Differs from the base in what an object store allows: `write_exclusive` is a
conditional single PUT (If-None-Match); deletes go out in batches of 1000;
listings are never cached (other processes commit checkpoints meanwhile).

Options are s3fs's: ``key``, ``secret``, ``token``, ``profile``,
``client_kwargs={"endpoint_url": ..., "region_name": ...}``, ``config_kwargs``...
Without options, the standard ``AWS_*`` variables of this process are read
(s3fs's own behaviour; the endpoint from ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``), captured once as explicit options so executors elsewhere
get the same. Nothing here writes credentials into the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec

from statebackend.errors import UsageError
from statebackend.storage.base import Storage

DELETE_BATCH = 1000  # S3's DeleteObjects limit

# Standard AWS variables read (never written) when an s3 root gets no options.
_ENV_OPTIONS = (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"),
                ("token", "AWS_SESSION_TOKEN"))


class S3Storage(Storage):
    scheme = "s3"
    remote = True

    def write_exclusive(self, rel: str, data: bytes) -> None:
        with self._errors(rel):
            self.fs.pipe_file(self.abspath(rel), data, mode="create")

    def delete_many(self, rels: Iterable[str]) -> list[tuple[str, str]]:
        paths = [self.abspath(r) for r in rels]
        failures: list[tuple[str, str]] = []
        for i in range(0, len(paths), DELETE_BATCH):
            batch = paths[i : i + DELETE_BATCH]
            try:
                self.fs.rm(batch)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - best effort, reported
                failures.extend((self.relpath(p), str(exc)) for p in batch)
        return failures

    def check_reachable(self) -> None:
        with self._errors("/"):
            try:
                self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise  # a missing prefix is fine; a missing bucket is not


def environment_s3_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The s3 options s3fs would take from this process's ``AWS_*`` variables, explicit.

    Captured on the driver so that executors on other hosts reach the same storage;
    without an access key nothing is captured and botocore's own chain (profile,
    instance role) applies wherever the storage is opened.
    """
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        options = {name: env[var] for name, var in _ENV_OPTIONS if env.get(var)}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def s3_storage_options(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec s3 options: the library's settings, then ``options`` (or the environment's)."""
    given = dict(options) if options else environment_s3_options()
    merged: dict[str, Any] = {
        # Listings must be fresh: other processes (executors, other runs, the CLI)
        # commit checkpoints and upload files; a cached listing hides them.
        "use_listings_cache": False,
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                          "retries": {"max_attempts": 3, "mode": "standard"}},
    }
    for name, value in given.items():
        if name in ("client_kwargs", "config_kwargs") and isinstance(value, Mapping):
            merged[name] = {**merged.get(name, {}), **value}
        else:
            merged[name] = value
    return merged


def open_s3(url: str, bucket: str, path: str, options: Mapping[str, Any]) -> S3Storage:
    if not bucket:
        raise UsageError(f"S3 storage URL {url!r} names no bucket")
    given = dict(options) or environment_s3_options()
    try:
        fs = fsspec.filesystem("s3", **s3_storage_options(given))
    except ImportError as exc:
        raise UsageError("s3:// storage needs the s3 extra: "
                         "pip install 'ckpt-lifecycle[s3]'") from exc
    except TypeError as exc:  # an option s3fs does not know
        raise UsageError(f"storage {url}: unknown storage option(s) {sorted(given)} "
                         f"({exc}); see s3fs.S3FileSystem for the names") from exc
    return S3Storage(url, fs, (bucket + path).rstrip("/"), options=given)
