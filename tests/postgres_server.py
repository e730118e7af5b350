"""A real PostgreSQL server (Debian's package) for the tests, on 127.0.0.1 only.

`PostgresServer` runs ``initdb`` in a fresh folder (trust authentication for one role),
starts ``postgres`` on a free loopback port with its socket in that folder, and stops it
by its PID. Durability settings are off: the tests restart it, they never crash it.
As root (CI containers) the server runs as the ``postgres`` user, as PostgreSQL requires.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
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
    """A free loopback port below the kernel's ephemeral range. The tests restart the
    server on its port; a port the kernel picked (``bind(0)``) is one it also hands to
    client sockets, so while the server is down any outgoing connection on the machine
    could take it and the restart would fail to listen."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


class PostgresServer:
    """One server: `start`, `restart`, `stop`; `url` for the clients."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ckpt-pg-")
        os.chmod(self.root, 0o755)
        self.data = os.path.join(self.root, "data")
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self._restarting = threading.Lock()
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
            if self.process.poll() is not None:  # e.g. its port taken: say so now
                raise RuntimeError(f"postgres exited with {self.process.returncode} on "
                                   f"port {self.port}; see {self.root}/server.log")
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
        """Stop, then start; calls from several threads at once (subtasks) take turns."""
        with self._restarting:
            self.stop()
            self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
