"""`CheckpointHook`: a job's checkpoint store from an Airflow connection and a URL.

    hook = CheckpointHook("aws_ckpt", storage="s3://bucket/checkpoints", job="clicks")
    store = hook.get_store()          # statebackend.checkpoint.store.CheckpointStore

The operators hold one as their cached ``hook`` property (as Airflow's providers do),
so a task reads its connection once.

The connection (an ``aws`` connection, see `statebackend.airflow.connection`)
becomes storage options; without a connection id the storage opens with the
worker's own AWS settings (its environment, profile or instance role), as s3fs
does. An external-backend job's database is ``state_db`` (a `StateDatabase`: a URL or
a postgres connection), read when a task asks for it (`get_state_db`).
Nothing is written into ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow.sdk import BaseHook

from statebackend.airflow.connection import StateDatabase, storage_options_from_connection
from statebackend.checkpoint.store import CheckpointStore
from statebackend.state.external_store import ExternalStore
from statebackend.storage import Storage, open_storage


class CheckpointHook(BaseHook):
    """Opens the checkpoint storage of one job with a connection's credentials."""

    conn_name_attr = "conn_id"
    default_conn_name = "aws_default"
    conn_type = "aws"
    hook_name = "Checkpoint storage (AWS connection)"

    def __init__(self, conn_id: str | None = None, *, storage: str, job: str,
                 get_connection: Callable[[str], Any] | None = None,
                 state_db: StateDatabase | None = None) -> None:
        super().__init__()
        self.conn_id = conn_id or None
        self.storage = storage
        self.job = job
        self.state_db = state_db or StateDatabase()
        self._get_connection = get_connection
        self._options: dict | None = None

    def storage_options(self) -> dict:
        """fsspec options from the connection (read once per hook); {} without one."""
        if self._options is None:
            self._options = storage_options_from_connection(self.conn_id, self._get_connection)
        return self._options

    def get_storage(self) -> Storage:
        """The storage root (all jobs), opened with the connection's options."""
        return open_storage(self.storage, **self.storage_options())

    def get_store(self) -> CheckpointStore:
        """The job's `CheckpointStore`."""
        return CheckpointStore(self.get_storage(), self.job)

    def state_db_url(self) -> str | None:
        """The external backend's database URL (None: not configured)."""
        return self.state_db.url_now(self._get_connection)

    def get_state_db(self) -> ExternalStore | None:
        """The external backend's database and state table (None: not configured)."""
        return self.state_db.store(self._get_connection)

    def test_connection(self) -> tuple[bool, str]:
        """Airflow's "Test connection": can the storage root be listed?"""
        try:
            self.get_storage().check_reachable()
        except Exception as exc:  # noqa: BLE001 - reported to the UI as one line
            return False, str(exc)
        return True, f"storage {self.storage} is reachable"
