"""Storage options from an Airflow AWS connection, the external state backend's
database URL from an Airflow postgres connection, and the registry index's signing key
from any connection's password; nothing goes through ``os.environ``.

The connection is read the way Airflow's amazon provider reads an ``aws``
connection (that provider is not a dependency of this package, so the fields
are parsed here; the names are the provider's, so one connection serves both):

- login / password: access key id / secret access key (or extra
  ``aws_access_key_id`` / ``aws_secret_access_key``); extra ``aws_session_token``;
- extra ``endpoint_url``, or ``service_config.s3.endpoint_url`` (MinIO, a test server);
- extra ``region_name``;
- extra ``profile_name``: a profile of the worker's AWS config files (used when
  the connection holds no keys);
- extra ``role_arn`` (+ ``assume_role_kwargs``, ``assume_role_method`` =
  ``assume_role`` only): the role is assumed with STS once per call, and the
  temporary credentials become the options (executors need no AWS config).

The result is fsspec's s3 options (`statebackend.storage.open_storage`). Only the
connection id and the option names are logged, never a value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from statebackend.errors import UsageError
from statebackend.lifecycle.index_signing import checked_key
from statebackend.state.external_store import DEFAULT_TABLE, ExternalStore

log = logging.getLogger(__name__)

AWS_CONN_TYPES = ("aws", "s3")  # "s3" is the provider's old name for the same type
ASSUME_ROLE_METHODS = ("assume_role",)


class ConnectionConfigError(UsageError):
    """A storage connection is missing, of the wrong type or incomplete."""


def default_get_connection(conn_id: str):
    """The Task SDK's lookup in a task; the server's (secrets backends, metadata DB) in
    Airflow's own processes such as the API server that serves the Checkpoints page."""
    from airflow.sdk import BaseHook

    try:
        return BaseHook.get_connection(conn_id)
    except Exception as sdk_error:
        try:
            from airflow.models.connection import Connection
        except ImportError:
            raise sdk_error from None
        return Connection.get_connection_from_secrets(conn_id)


def storage_options_from_connection(conn_id: str | None,
                                    get_connection: Callable[[str], Any] | None = None) -> dict:
    """fsspec s3 options of AWS connection ``conn_id``; ``{}`` when ``conn_id`` is empty."""
    if not conn_id:
        return {}
    conn = _read_connection(conn_id, get_connection, "storage", "aws")
    options = options_from_fields(conn_id, getattr(conn, "conn_type", None), conn.login,
                                  conn.password, _extra(conn))
    log.info("storage connection %r gives storage options %s", conn_id, sorted(options))
    return options


POSTGRES_CONN_TYPES = ("postgres", "postgresql")


@dataclass(frozen=True)
class StateDatabase:
    """Where an external-backend job's state lives, as configured: ``url`` (``state_db``)
    or the postgres connection ``conn_id`` (``state_db_conn_id``), and the ``table``.
    The connection is read when asked (`url_now`), never while a DAG file is parsed."""

    url: str | None = None
    conn_id: str | None = None
    table: str = DEFAULT_TABLE

    def url_now(self, get_connection: Callable[[str], Any] | None = None) -> str | None:
        """The database URL: ``url`` if given, else the connection's (None: neither)."""
        return self.url or state_db_from_connection(self.conn_id, get_connection)

    def store(self, get_connection: Callable[[str], Any] | None = None
              ) -> ExternalStore | None:
        """The database and state table (None: not configured)."""
        url = self.url_now(get_connection)
        return ExternalStore(url, self.table) if url else None


def state_db_from_connection(conn_id: str | None,
                             get_connection: Callable[[str], Any] | None = None) -> str | None:
    """The external backend's database URL (``postgresql://login:password@host:port/
    schema``) of postgres connection ``conn_id``; None without one. Only the id is logged."""
    if not conn_id:
        return None
    conn = _read_connection(conn_id, get_connection, "state_db", "postgres")
    conn_type = getattr(conn, "conn_type", None)
    if conn_type not in POSTGRES_CONN_TYPES or not conn.host:
        raise ConnectionConfigError(f"state database connection {conn_id!r} must be of type "
                                    f"postgres with a host (it is {conn_type!r})")
    user = quote(conn.login or "", safe="")
    password = f":{quote(conn.password, safe='')}" if conn.password else ""
    auth = f"{user}{password}@" if user else ""
    port = f":{int(conn.port)}" if conn.port else ""
    log.info("state database connection %r read", conn_id)
    return f"postgresql://{auth}{conn.host}{port}/{quote(conn.schema or 'postgres', safe='')}"


def index_key_from_connection(conn_id: str | None,
                              get_connection: Callable[[str], Any] | None = None
                              ) -> bytes | None:
    """The registry index's signing key (statebackend.lifecycle.index_signing): the
    password of connection ``conn_id`` (any type; at least 16 bytes), the same on every
    worker; None without one. Only the id is logged, never the key."""
    if not conn_id:
        return None
    conn = _read_connection(conn_id, get_connection, "index_key", "generic")
    if not conn.password:
        raise ConnectionConfigError(f"index key connection {conn_id!r} has no password: put "
                                    "the key there (e.g. `openssl rand -hex 32`)")
    key = checked_key(conn.password.encode(), f"connection {conn_id!r}")
    log.info("index key connection %r read", conn_id)
    return key


def _read_connection(conn_id: str, get_connection: Callable[[str], Any] | None, use: str,
                     conn_type: str) -> Any:
    """Connection ``conn_id`` (``use``: the ckpt_jobs key's stem); any lookup failure is
    one line naming the id, the type to create and the key to fix."""
    try:
        return (get_connection or default_get_connection)(conn_id)
    except Exception as exc:  # noqa: BLE001 - any lookup failure is one line naming the id
        what = use.replace("_db", " database").replace("_", " ")
        raise ConnectionConfigError(
            f"{what} connection {conn_id!r} cannot be read ({type(exc).__name__}); create it "
            f"(type {conn_type}) or fix {use}_conn_id in ckpt_jobs") from exc


def _extra(conn) -> dict:
    extra = getattr(conn, "extra_dejson", None)
    if isinstance(extra, Mapping):
        return dict(extra)
    raw = getattr(conn, "extra", None) or {}
    if isinstance(raw, str):
        import json

        try:
            raw = json.loads(raw)
        except ValueError:
            raw = {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def options_from_fields(conn_id: str, conn_type: str | None, login: str | None,
                        password: str | None, extra: Mapping[str, Any]) -> dict:
    """The options of one connection's fields (pure, except STS for ``role_arn``)."""
    if conn_type and conn_type not in AWS_CONN_TYPES:
        raise ConnectionConfigError(f"storage connection {conn_id!r} has type {conn_type!r}; "
                                    "use an 'aws' connection (Amazon Web Services)")
    key = login or extra.get("aws_access_key_id")
    secret = password or extra.get("aws_secret_access_key")
    if bool(key) != bool(secret):
        missing = "secret access key (password)" if key else "access key id (login)"
        raise ConnectionConfigError(f"storage connection {conn_id!r} has no {missing}; give "
                                    "both keys, or neither to use a profile or role")
    options: dict[str, Any] = {}
    if key:
        options.update(key=key, secret=secret)
        if extra.get("aws_session_token"):
            options["token"] = extra["aws_session_token"]
    elif extra.get("profile_name"):
        options["profile"] = extra["profile_name"]
    client_kwargs = {}
    endpoint = extra.get("endpoint_url") or _service(extra, "s3").get("endpoint_url")
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if extra.get("region_name"):
        client_kwargs["region_name"] = extra["region_name"]
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    if extra.get("role_arn"):
        options.update(assume_role(conn_id, extra, options))
        options.pop("profile", None)
    return options


def _service(extra: Mapping[str, Any], service: str) -> dict:
    config = extra.get("service_config") or {}
    value = config.get(service) if isinstance(config, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else {}


def assume_role(conn_id: str, extra: Mapping[str, Any], base: Mapping[str, Any]) -> dict:
    """Temporary ``key``/``secret``/``token`` of ``extra['role_arn']`` (STS AssumeRole)."""
    import botocore.session

    method = extra.get("assume_role_method") or "assume_role"
    if method not in ASSUME_ROLE_METHODS:
        raise ConnectionConfigError(
            f"storage connection {conn_id!r}: assume_role_method {method!r} is not supported "
            f"here (only {list(ASSUME_ROLE_METHODS)}); assume the role outside and give its "
            "keys, or use a profile")
    kwargs = dict(extra.get("assume_role_kwargs") or {})
    kwargs.setdefault("RoleSessionName", f"ckpt-{conn_id}")
    session = botocore.session.Session(profile=base.get("profile"))
    if base.get("key"):
        session.set_credentials(base["key"], base["secret"], base.get("token"))
    endpoint = _service(extra, "sts").get("endpoint_url") or extra.get("endpoint_url")
    sts = session.create_client("sts", region_name=extra.get("region_name") or "us-east-1",
                                endpoint_url=endpoint)
    try:
        creds = sts.assume_role(RoleArn=extra["role_arn"], **kwargs)["Credentials"]
    except Exception as exc:  # noqa: BLE001 - botocore errors: one line, no secrets in them
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConnectionConfigError(f"storage connection {conn_id!r}: assuming role "
                                    f"{extra['role_arn']!r} failed: {text}") from exc
    log.info("storage connection %r: assumed role %s", conn_id, extra["role_arn"])
    return {"key": creds["AccessKeyId"], "secret": creds["SecretAccessKey"],
            "token": creds["SessionToken"]}
