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

Validation picks up checks from three places, later ones winning per state name:
modules listed in `CHECK_MODULES` (imported when validation runs, skipped when
not installed), `register_state_checks` calls, and the ``state_checks``
argument of `statebackend.validate.validate_checkpoint`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..state import StateDescriptor

StateCheck = Callable[[StateDescriptor], "list[Any] | None"]

# Job modules that register checks at import (see jobs/keyed_aggregation_checks.py).
CHECK_MODULES = ("jobs.keyed_aggregation_checks",)

_REGISTRY: dict[str, StateCheck] = {}


def register_state_checks(state_name: str, fn: StateCheck) -> StateCheck:
    """Register ``fn`` for every checkpoint state called ``state_name``; returns fn."""
    _REGISTRY[state_name] = fn
    return fn


def unregister_state_checks(state_name: str) -> None:
    _REGISTRY.pop(state_name, None)


def registered_state_checks(extra: Mapping[str, StateCheck] | None = None
                            ) -> dict[str, StateCheck]:
    """The checks in effect: CHECK_MODULES, then the registry, then ``extra``."""
    for name in CHECK_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, name.split(".")[0]):
                raise
    checks = dict(_REGISTRY)
    checks.update(extra or {})
    return checks
