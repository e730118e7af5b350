"""Every ``CKPT_*`` setting and numeric knob, declared once with its range.

A setting is read from the process environment (`value`; typed: `seconds`,
`byte_count`, `choice`), a numeric flag or argument is checked against the same kind
of range (`number`), a yes/no value (a rendered Airflow template, a CLI or job
option) is read by `boolean`; each refuses a bad value in one line that names the
variable, flag or argument, the value and what is accepted, before any work. Nothing
here guesses: ``inf``, ``nan``, a negative size or a heartbeat that would spin are
refused, not clamped.

    CKPT_LEASE_TTL_SECONDS          lease lifetime (s), default 60, in [0.5, 604800]
    CKPT_LEASE_HEARTBEAT_SECONDS    renewal period (s), default TTL/4, in [0.05, TTL/2]
    CKPT_ENGINE                     auto | spark | local (default auto)
    CKPT_LOCAL_ENGINE_MAX_BYTES     input bytes (decompressed) `auto` runs locally, 64 MiB
    CKPT_LOCAL_ENGINE_MAX_STATE_BYTES  parent state a cluster run keeps local, 256 MiB
    CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES decompressed input a local-engine run may hold, 1 GiB
    CKPT_SPARK_DIRECT_READ_MAX_BYTES decompressed input x min(P, cores) read directly, 512 MiB
    CKPT_PROGRESS                   auto | bar | lines | off
    CKPT_PROGRESS_INTERVAL          seconds between progress lines, default 5, in [0.001, 86400]
    CKPT_LOCAL_DIR                  executors' local-recovery root (a path)
    CKPT_ROW_COUNTS                 tracked | scan | verify: a RocksDB snapshot's row counts
    CKPT_INDEX_KEY_FILE             the key that signs registry indexes, or ``off``
                                    (statebackend.lifecycle.index_signing)
    CKPT_PYTHON_GC_THRESHOLD        Python's gen-0 GC threshold while subtasks run (and
                                    older objects frozen), 2000; 0: the process's own
                                    (statebackend.python_gc)

`check_environment` validates every one that is set (the CLI and a job run call it
first). This module imports only `statebackend.errors` and `defaults`: DAG files and
executors may import it at no cost.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from statebackend import defaults
from statebackend.errors import UsageError

MIN_HEARTBEAT_SECONDS = 0.05  # a faster renewal is a busy loop on the lease file
MAX_SECONDS = 7 * 24 * 3600.0  # a week: anything longer is a typo or `inf`
MAX_BYTES = 2**50              # a PiB: larger is a typo
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One ``CKPT_*`` variable: its kind, default and range (numbers) or choices."""

    name: str
    kind: str                      # "seconds" | "bytes" | "count" | "choice" | "path"
    default: float | int | str | None
    help: str
    minimum: float = 0.0
    maximum: float = math.inf
    choices: tuple[str, ...] = ()

    def parse(self, text: str) -> float | int | str:
        """The value of ``text``; UsageError naming the variable, the value and the range."""
        text = text.strip()
        if self.kind == "path":
            if not text:
                raise UsageError(f"{self.name} is set but empty: unset it or name a folder")
            return text
        if self.kind == "choice":
            value = text.lower()
            if value not in self.choices:
                raise UsageError(f"{self.name}={text!r} is unknown; use one of "
                                 f"{list(self.choices)}")
            return value
        return number(text, self.name, minimum=self.minimum, maximum=self.maximum,
                      integer=self.kind in ("bytes", "count"))


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("CKPT_LEASE_TTL_SECONDS", "seconds", 60.0,
            "how long a lease lives without renewal", minimum=0.5, maximum=MAX_SECONDS),
    Setting("CKPT_LEASE_HEARTBEAT_SECONDS", "seconds", None,
            "how often a held lease is renewed (default TTL/4; at most TTL/2)",
            minimum=MIN_HEARTBEAT_SECONDS, maximum=MAX_SECONDS),
    Setting("CKPT_ENGINE", "choice", defaults.ENGINE, "the engine of job runs",
            choices=defaults.ENGINES),
    Setting("CKPT_LOCAL_ENGINE_MAX_BYTES", "bytes", defaults.LOCAL_ENGINE_MAX_BYTES,
            "decompressed input bytes up to which `auto` runs the local engine",
            maximum=MAX_BYTES),
    Setting("CKPT_LOCAL_ENGINE_MAX_STATE_BYTES", "bytes", defaults.LOCAL_ENGINE_MAX_STATE_BYTES,
            "parent state up to which a cluster run takes the local engine", maximum=MAX_BYTES),
    Setting("CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES", "bytes",
            defaults.LOCAL_ENGINE_MAX_MEMORY_BYTES,
            "decompressed input a local-engine run may hold in memory", minimum=1,
            maximum=MAX_BYTES),
    Setting("CKPT_SPARK_DIRECT_READ_MAX_BYTES", "bytes", defaults.SPARK_DIRECT_READ_MAX_BYTES,
            "decompressed input bytes times min(P, cores) up to which Spark's tasks "
            "each read the whole input (no shuffle; 0: always shuffle)", maximum=MAX_BYTES),
    Setting("CKPT_PROGRESS", "choice", "auto", "progress display on stderr",
            choices=("auto", "bar", "lines", "off")),
    Setting("CKPT_PROGRESS_INTERVAL", "seconds", 5.0, "seconds between progress lines",
            minimum=0.001, maximum=86400.0),
    Setting("CKPT_LOCAL_DIR", "path", None, "executors' local-recovery root"),
    Setting("CKPT_ROW_COUNTS", "choice", "tracked",
            "a RocksDB snapshot's row counts: tracked through the writes that know them "
            "(else a scan), a scan every time, or tracked and verified by a scan",
            choices=("tracked", "scan", "verify")),
    Setting("CKPT_INDEX_KEY_FILE", "path", None,
            "this host's key that signs registry indexes (default "
            "~/.local/state/ckpt/index-key, made on first use; `off`: never signed)"),
    Setting("CKPT_PYTHON_GC_THRESHOLD", "count", defaults.PYTHON_GC_THRESHOLD,
            "the youngest generation's garbage-collection threshold while subtasks run, "
            "older objects frozen (0: leave the process's collector alone)", maximum=10**9),
)}


def value(name: str, environ: Mapping[str, str] | None = None) -> float | int | str | None:
    """The setting ``name`` from the environment (checked), else its default."""
    setting = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or (not text.strip() and setting.kind != "path"):
        return setting.default
    return setting.parse(text)


def seconds(name: str, environ: Mapping[str, str] | None = None) -> float:
    """The "seconds" setting ``name`` (checked), else its default."""
    got = value(name, environ)
    if isinstance(got, str) or got is None:
        raise LookupError(f"{name} is not a seconds setting with a default")
    return float(got)


def byte_count(name: str, environ: Mapping[str, str] | None = None) -> int:
    """The "bytes" setting ``name`` (checked), else its default."""
    got = value(name, environ)
    if not isinstance(got, int):
        raise LookupError(f"{name} is not a bytes setting")
    return got


def count(name: str, environ: Mapping[str, str] | None = None) -> int:
    """The "count" setting ``name`` (checked), else its default."""
    got = value(name, environ)
    if not isinstance(got, int):
        raise LookupError(f"{name} is not a count setting")
    return got


def choice(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The "choice" setting ``name`` (checked, lower case), else its default."""
    got = value(name, environ)
    if not isinstance(got, str):
        raise LookupError(f"{name} is not a choice setting")
    return got


def local_root(local_dir: str | None = None) -> str:
    """This machine's local-recovery root: ``local_dir``, else ``CKPT_LOCAL_DIR``, else
    ``<tmp>/ckpt-local`` (statebackend.checkpoint.local_copy; the Connect session records
    live under it too)."""
    return local_dir or os.environ.get("CKPT_LOCAL_DIR") or os.path.join(
        tempfile.gettempdir(), "ckpt-local")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every declared setting that is set (UsageError on the first bad one),
    and the lease timing as a pair (heartbeat at most half the TTL)."""
    env = os.environ if environ is None else environ
    for name in SETTINGS:
        value(name, env)
    lease_timing(environ=env)


def lease_timing(ttl_seconds: float | None = None, heartbeat_seconds: float | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(ttl, heartbeat) from the arguments, else the environment, else the defaults.

    Two missed beats must still leave a lease alive, or a busy holder loses it: the
    heartbeat is at most TTL/2; and at least `MIN_HEARTBEAT_SECONDS` (no busy loop)."""
    ttl_source = "ttl_seconds" if ttl_seconds is not None else "CKPT_LEASE_TTL_SECONDS"
    ttl = float(number(ttl_seconds, ttl_source, minimum=0.5, maximum=MAX_SECONDS)
                if ttl_seconds is not None else seconds("CKPT_LEASE_TTL_SECONDS", environ))
    if heartbeat_seconds is not None:
        beat_source, beat = "heartbeat_seconds", float(number(
            heartbeat_seconds, "heartbeat_seconds", minimum=MIN_HEARTBEAT_SECONDS,
            maximum=MAX_SECONDS))
    else:
        beat_source = "CKPT_LEASE_HEARTBEAT_SECONDS"
        configured = value(beat_source, environ)
        beat = float(configured) if configured is not None else max(
            MIN_HEARTBEAT_SECONDS, ttl / 4)
    if beat > ttl / 2:
        raise UsageError(f"{beat_source} {beat:g} s is more than half of {ttl_source} "
                         f"{ttl:g} s: a lease would lapse between two renewals; use at most "
                         f"{ttl / 2:g} s")
    return ttl, beat


def number(raw: object, what: str, *, minimum: float = 0.0, maximum: float = math.inf,
           integer: bool = False) -> float | int:
    """``raw`` (a number or its text) checked to be finite and in [minimum, maximum].

    ``what`` names it in the error (a variable, a flag like ``--grace-seconds``)."""
    kind = "an integer" if integer else "a number"
    shown = f"{what}={raw!r}" if what.startswith("CKPT_") else f"{what} {raw}"
    if isinstance(raw, bool):
        raise UsageError(f"{shown} is not {kind}")
    if isinstance(raw, str):
        text = raw.strip().replace("_", "")
        try:
            parsed: float | int = int(text) if integer else float(text)
        except ValueError:
            raise UsageError(f"{shown} is not {kind}") from None
    elif isinstance(raw, int | float):
        parsed = raw
    else:
        raise UsageError(f"{shown} is not {kind}")
    if integer and not isinstance(parsed, int):
        if not float(parsed).is_integer():
            raise UsageError(f"{shown} is not {kind}")
        parsed = int(parsed)
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise UsageError(f"{shown} is not a finite number")
    if not minimum <= parsed <= maximum:
        upper = "" if maximum == math.inf else f" and at most {maximum:g}"
        raise UsageError(f"{shown} is out of range: use at least {minimum:g}{upper}")
    return parsed


def boolean(raw: object, what: str) -> bool:
    """``raw`` as a bool: a bool itself, or one of `TRUE_WORDS` / `FALSE_WORDS` (any case,
    spaces around ignored: a rendered template reads ``"True"``). Anything else, ``"maybe"``
    included, is refused in one line naming ``what`` (a variable, a flag, an argument)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    shown = f"{what}={raw!r}" if what.startswith("CKPT_") else f"{what} {raw!r}"
    raise UsageError(f"{shown} is not a boolean; use one of {list(TRUE_WORDS)} or "
                     f"{list(FALSE_WORDS)}")
