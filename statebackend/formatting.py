"""Figures for people: sizes, durations, ages, counts and times, for the CLI and the page.

One formatter per kind of figure, so ``ckpt list`` and the Checkpoints page say
``1.2 MiB`` and ``3 min ago`` alike:

- `human_bytes`     ``1023 B``, ``1.2 MiB`` (binary units, one decimal above bytes)
- `human_duration`  a measured duration: ``250 ms``, ``12.5 s``, ``14 min``, ``2.5 h``, ``3 d``
- `human_age`       how long ago: ``just now``, ``59 s ago``, ``3 min ago``, ``2 h ago``
- `human_count`     ``12,345``; a fraction keeps one decimal below 100 (a rate: ``2.5``)
- `parse_time`      an ISO-8601 text as an aware datetime (naive ones are UTC), or None
- `age_of`          the age of an ISO-8601 text (``-`` when absent, the text when unreadable)
- `epoch_ms`        ``1700000000000 (2023-11-14T22:13:20.000+00:00)`` (``-`` when not set)

A figure that was not recorded (None) reads `UNKNOWN` (``–``). Imports nothing of the
library: every layer may use it.
"""

from __future__ import annotations

from datetime import UTC, datetime

UNKNOWN = "–"
_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
# (below this many seconds, divide by, unit, decimals): a duration's coarsest readable unit
_DURATION_STEPS = ((1, 0.001, "ms", 0), (120, 1, "s", 1), (7200, 60, "min", 0),
                   (172800, 3600, "h", 1))
_AGE_STEPS = ((60, 1, "s"), (3600, 60, "min"), (86400, 3600, "h"))


def human_bytes(n: float | None) -> str:
    """``1.2 MiB``: binary units, one decimal above bytes; `UNKNOWN` for None."""
    if n is None:
        return UNKNOWN
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _BYTE_UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable: the last unit returns")


def human_duration(seconds: float | None) -> str:
    """A measured duration in its coarsest readable unit; `UNKNOWN` for None."""
    if seconds is None:
        return UNKNOWN
    for limit, size, unit, decimals in _DURATION_STEPS:
        if seconds < limit:
            return f"{seconds / size:.{decimals}f} {unit}"
    return f"{seconds / 86400:.0f} d"


def human_age(seconds: float | None) -> str:
    """``3 min ago`` (whole units); a time ahead of this clock (skew) reads ``just now``."""
    if seconds is None:
        return UNKNOWN
    if seconds < 1:
        return "just now"
    for limit, size, unit in _AGE_STEPS:
        if seconds < limit:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds // 86400)} d ago"


def human_count(n: float | None) -> str:
    """``12,345``; below 100 a fraction keeps one decimal; `UNKNOWN` for None."""
    if n is None:
        return UNKNOWN
    return f"{n:,.0f}" if n >= 100 or n == int(n) else f"{n:,.1f}"


def rows_text(n: int | None) -> str:
    """``12 rows``; None (not recorded: a rescale that read nothing, e.g. an external
    checkpoint's, whose rows are in its database) says so rather than ``0 rows``."""
    return "rows not recorded" if n is None else f"{n} rows"


def parse_time(text: object) -> datetime | None:
    """An ISO-8601 text as an aware datetime (a naive one is UTC); None when unreadable."""
    try:
        when = datetime.fromisoformat(str(text))
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def age_of(iso_time: str | None, now: datetime | None = None) -> str:
    """The age of an ISO-8601 timestamp, ``-`` when absent, the text when unreadable."""
    if not iso_time:
        return "-"
    when = parse_time(iso_time)
    if when is None:
        return iso_time
    return human_age(((now or datetime.now(UTC)) - when).total_seconds())


def epoch_ms(value: int | None) -> str:
    """``1700000000000 (2023-11-14T22:13:20.000+00:00)``, or ``-`` when not set."""
    if value is None:
        return "-"
    try:
        when = datetime.fromtimestamp(value / 1000, UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):  # outside what datetime can show
        return str(value)
    return f"{value} ({when})"
