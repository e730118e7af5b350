"""Spark Connect sessions kept on the server across the runs of one job.

Why: a Connect server starts Python workers per session (Spark keys each worker
factory by the session's artifact UUID), so a client process that opens a new session
waits for new workers before its first Spark job: 2.1-2.2 s on our machines, against
0.34-0.44 s for a client that attaches to an existing session
(``sc://host:port/;session_id=ID``) and gets that session's idle workers, the same
processes.

How (`JobSession`):

- A job's runs attach to one session. Its id is recorded on the client machine,
  under the local-recovery root (``<root>/connect-sessions/<digest>.json``, one file
  per Connect server, storage root and job folder). The job's rescales and migrations
  keep a session each of their own (``purpose``): they import other code than its runs,
  and sharing one record would replace it at every switch.
- A run ends without releasing the session, so its workers wait for the next run.
- The record also holds a digest of the code the workers import: every ``.py`` file
  of the packages this process imported from the folders on ``PYTHONPATH`` and of the
  library (path, size, mtime). A changed job or library opens a new session, so a
  reused worker never runs code older than the driver's.
- The server closes a session left idle longer than
  ``spark.connect.session.manager.defaultSessionTimeout`` (60 min by default) and then
  refuses its id (``INVALID_HANDLE.SESSION_CLOSED``); the run then opens a new session
  and records it (new workers, once). The closed one is never used again.
- Runs and rescales of one job never overlap (the writer lease), and different jobs
  have different sessions, so no two of them share a session at once (two migrations
  into one job may: a Connect session serves concurrent operations). A run's session settings
  (`statebackend.spark.session.RUNTIME_SETTINGS`) are set again by every run.

``--connect-session new`` opens a session of its own for each command, released at its
end (the server then keeps that session's Python workers until it cleans it up: many
short-lived sessions grow its memory). A URL that names a ``session_id`` itself is used as given.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass

from statebackend.defaults import CONNECT_SESSIONS
from statebackend.errors import UsageError
from statebackend.settings import local_root

CONNECT_SCHEME = "sc://"
SESSION_CLOSED = ("INVALID_HANDLE.SESSION_CLOSED", "INVALID_HANDLE.SESSION_NOT_FOUND")
RECORD_FORMAT = 1


@dataclass(frozen=True)
class JobSession:
    """Where the session id of one job's runs (or rescales, or migrations: ``purpose``) on
    one Connect server is recorded."""

    server: str    # sc://host:port, without the URL's parameters (`server_of`)
    storage: str   # the storage root URL
    job: str       # the job's folder under it
    folder: str    # <local-recovery root>/connect-sessions
    purpose: str = "run"  # run, rescale or migrate

    @property
    def path(self) -> str:
        parts = (self.server, self.storage, self.job)
        key = "\n".join(parts if self.purpose == "run" else (*parts, self.purpose))
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")

    def recorded(self, code: str) -> str | None:
        """The recorded session id, if it was opened for ``code`` (a `code_digest`)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            if data.get("format") == RECORD_FORMAT and data.get("code") == code:
                return str(uuid.UUID(str(data["session_id"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no record, or not ours: a new session
        return None

    def record(self, session_id: str, code: str) -> None:
        """Record ``session_id`` (best effort: a run without a record opens a new one)."""
        data = {"format": RECORD_FORMAT, "server": self.server, "storage": self.storage,
                "job": self.job, "purpose": self.purpose, "code": code,
                "session_id": session_id}
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def kept_session(master: str | None, storage: str, job: str, *, purpose: str = "run",
                 mode: str = "job", local_dir: str | None = None) -> JobSession | None:
    """Where the session kept for ``job``'s ``purpose`` commands on Connect server
    ``master`` is recorded (under ``local_dir``'s local-recovery root); None: ``mode``
    is ``new`` (a session of the command's own) or ``master`` is not a Connect URL."""
    if mode not in CONNECT_SESSIONS:
        raise UsageError(f"connect session {mode!r} is not one of "
                         f"{', '.join(CONNECT_SESSIONS)}")
    if mode != "job" or master is None or not is_remote_url(master):
        return None
    return JobSession(server_of(master), storage, job,
                      os.path.join(local_root(local_dir), "connect-sessions"), purpose)


def is_remote_url(master: str | None) -> bool:
    """Whether ``master`` is a Spark Connect URL (``sc://host:port``)."""
    return master is not None and master.startswith(CONNECT_SCHEME)


def server_of(url: str) -> str:
    """``sc://host:port`` of a Connect URL: its parameters (a ``token`` among them) are
    never recorded."""
    return url.split("/;", 1)[0].rstrip("/")


def new_session_id() -> str:
    return str(uuid.uuid4())


def with_session_id(url: str, session_id: str) -> str:
    """``url`` (``sc://host:port[/;param=value...]``) naming ``session_id``."""
    return f"{url};session_id={session_id}" if "/;" in url else \
        f"{url.rstrip('/')}/;session_id={session_id}"


def names_session(url: str) -> bool:
    """Whether ``url`` names a session id itself."""
    return ";session_id=" in url


def is_session_closed(exc: BaseException) -> bool:
    """Whether ``exc`` is the server refusing a session id it closed."""
    return any(tag in str(exc) for tag in SESSION_CLOSED)


@functools.cache
def code_digest() -> str:
    """Digest of the code the workers import (module doc): once per process."""
    library = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # statebackend/
    roots = [os.path.abspath(p) + os.sep
             for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sources: set[str] = {library}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." in name or not path:
            continue
        path = os.path.abspath(path)
        if any(path.startswith(r) for r in roots):
            sources.add(os.path.dirname(path) if os.path.basename(path) == "__init__.py"
                        else path)
    h = hashlib.sha256()
    for source in sorted(sources):
        for path in sorted(_python_files(source)):
            try:
                st = os.stat(path)
            except OSError:
                continue
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _python_files(source: str) -> list[str]:
    """``source`` itself (a module file), or every ``.py`` file under it (a package)."""
    if not os.path.isdir(source):
        return [source]
    out = []
    for folder, dirs, names in os.walk(source):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return out
