"""Job-specific expectations on the state table of one state.

A job registers a *state check* for a state name::

    register_state_checks("totals", totals_checks)

``totals_checks(descriptor)`` receives the checkpoint's `StateDescriptor` of that
state and returns a list of Great Expectations expectations over the state's
table, or None when the state does not look like the one it knows (another job
may use the same name with another codec). The table has one row per decoded
entry with columns ``subtask``, ``key``, ``user_key``, ``key_group`` and, for a
record codec, one column per record field (for other codecs a ``value`` column).
Give each expectation ``meta={"check": "<name>", "critical": bool}``: the name is
what the summary reports (default: the expectation type), and ``critical``
(default True) decides whether a failure fails the validation.

A job declares its checks as `statebackend.job.Job.expectations`; the caller
that knows which job owns a checkpoint passes them (``validate_checkpoint(store, ref,
ValidationOptions(level="deep", state_checks=job.expectations))``, ``ckpt validate
--job-def MODULE:ATTR``).
Validation picks up checks from two places, later ones winning per state name:
`register_state_checks` calls and the ``state_checks`` argument. Nothing is
imported by name: which code runs never depends on what storage says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statebackend.state.kinds import StateDescriptor

# the descriptor's type by name: this module stays light (no RocksDB) for job modules
# and the validation entry point
StateCheck = Callable[["StateDescriptor"], "list[Any] | None"]

_REGISTRY: dict[str, StateCheck] = {}


def register_state_checks(state_name: str, fn: StateCheck) -> StateCheck:
    """Register ``fn`` for every checkpoint state called ``state_name``; returns fn."""
    _REGISTRY[state_name] = fn
    return fn


def unregister_state_checks(state_name: str) -> None:
    _REGISTRY.pop(state_name, None)


def registered_state_checks(extra: Mapping[str, StateCheck] | None = None
                            ) -> dict[str, StateCheck]:
    """The checks in effect: the registry, then ``extra``."""
    checks = dict(_REGISTRY)
    checks.update(extra or {})
    return checks
