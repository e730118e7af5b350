"""A real PostgreSQL server (Debian's package) for the tests, on 127.0.0.1 only.

`PostgresServer` runs ``initdb`` in a fresh folder (trust authentication for one role),
starts ``postgres`` on a free loopback port with its socket in that folder, and stops it
by its PID. Durability settings are off: the tests restart it, they never crash it.
As root (CI containers) the server runs as the ``postgres`` user, as PostgreSQL requires.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROLE = "ckpt"


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def available() -> bool:
    return _binary("initdb") is not None and _binary("postgres") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One server: `start`, `restart`, `stop`; `url` for the clients."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ckpt-pg-")
        os.chmod(self.root, 0o755)
        self.data = os.path.join(self.root, "data")
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self._as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        os.makedirs(self.data, mode=0o700)
        if self._as_user:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.data, "postgres")
        subprocess.run([*self._as_user, _binary("initdb"), "-D", self.data, "-U", ROLE,
                        "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True)

    @property
    def url(self) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        log = open(os.path.join(self.root, "server.log"), "ab")  # noqa: SIM115 (kept open)
        self.process = subprocess.Popen(
            [*self._as_user, _binary("postgres"), "-D", self.data, "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=60"],
            stdout=log, stderr=log)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                if os.path.exists(os.path.join(self.data, "postmaster.pid")):
                    time.sleep(0.3)  # accepting TCP before recovery ends: let it finish
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"postgres did not start; see {self.root}/server.log")

    def _pid(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as fh:
                return int(fh.readline())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        pid = self._pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGINT)  # fast shutdown: disconnects the clients
            except ProcessLookupError:
                pass
        if self.process is not None:
            self.process.wait(timeout=30)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
