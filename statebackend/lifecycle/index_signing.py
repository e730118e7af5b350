"""The key that signs registry indexes: a secret of this host, never of storage.

The registry index (registry.py) is a cache in storage of what each checkpoint's
`_metadata` references. Its SHA-256 catches a torn or edited file, but whoever can
write the index can recompute a digest, so an executor cannot take the index's word
for a record it is about to act on (gc.py, scenario 11). An HMAC-SHA256 under a key
kept outside storage can be made only by a process that holds the key, so a signed
index was written by this library on a host that shares the key, from the real records.

Where the key comes from (``CKPT_INDEX_KEY_FILE``):

- unset: ``$XDG_STATE_HOME/ckpt/index-key`` (default ``~/.local/state/ckpt/index-key``),
  32 random bytes created on first use (mode 0600, folder 0700): every process of this
  user on this host (CLI, Airflow tasks) shares it; a host that has another key simply
  does not trust the index (it is still used to plan; executors read the records again);
- a path: that file (give one shared file to several hosts to share the trust);
- ``off``: no key; indexes are written unsigned and never trusted.

A `CheckpointStore` opened with ``index_key`` (the Airflow provider's
``index_key_conn_id``: a connection's password, the same on every worker) uses that key
instead: hosts without a shared disk, such as Kubernetes pods that each start with an
empty home folder, then trust each other's indexes.

A key file that others may read or write (any group or other permission bit) or that
another user owns is not used (a warning says why): a signature anyone could make
proves nothing. A key that cannot be read or created leaves the index unsigned,
which costs speed, never safety.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets

from statebackend.errors import UsageError
from statebackend.settings import value

log = logging.getLogger(__name__)

KEY_BYTES = 32
KEY_SETTING = "CKPT_INDEX_KEY_FILE"
OFF = "off"


def key_path() -> str | None:
    """The key file this process uses, or None (``off``)."""
    configured = value(KEY_SETTING)
    if configured == OFF:
        return None
    if configured:
        return os.path.expanduser(str(configured))
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "ckpt", "index-key")


MIN_KEY_BYTES = 16


def signing_key(given: bytes | None = None) -> bytes | None:
    """``given`` (a store's own key), else this host's key (module doc), or None when
    there is none to use."""
    if given is not None:
        return given
    path = key_path()
    return None if path is None else _key_at(path)


def checked_key(key: bytes, source: str) -> bytes:
    """``key`` when it is long enough to sign with, else a one-line error naming its
    ``source`` (never the key)."""
    if len(key) < MIN_KEY_BYTES:
        raise UsageError(f"registry index key from {source} has {len(key)} bytes; at least "
                         f"{MIN_KEY_BYTES} are needed (e.g. `openssl rand -hex 32`)")
    return key


@functools.cache
def _key_at(path: str) -> bytes | None:
    try:
        return _read_or_create(path)
    except OSError as exc:
        log.warning("registry index key %s not usable (%s): indexes stay unsigned, so GC "
                    "and retention read every record they could act on", path, exc)
        return None


def _read_or_create(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        key = secrets.token_bytes(KEY_BYTES)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another process made it first: use theirs
            return _read_or_create(path)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        return key
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("registry index key %s is not used: it must be owned by this user "
                        "and readable by nobody else (chmod 600 %s)", path, path)
            return None
        key = fh.read()
    if len(key) < MIN_KEY_BYTES:
        log.warning("registry index key %s is not used: %d bytes, at least %d needed",
                    path, len(key), MIN_KEY_BYTES)
        return None
    return key


def sign(key: bytes, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``body`` under ``key``."""
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def signed_by(key: bytes | None, body: bytes, mac: object) -> bool:
    """Whether ``mac`` is ``body``'s signature under ``key`` (False without a key)."""
    return key is not None and isinstance(mac, str) and hmac.compare_digest(
        sign(key, body), mac)
