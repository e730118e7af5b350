"""Names of the column families the backend reserves for itself (internal states).

The backend records them in ``_metadata`` like states, so restore, rescale, dump and
validation carry them; no user state may take one of these names. They live here, at
the bottom of ``state/``, so `kinds`, `timers`, `ttl` and `backend` share the names
without importing each other.
"""

from __future__ import annotations

TTL_INDEX = "_ttl"  # the TTL expiry index (statebackend.state.ttl)
TIMERS = "_timers"  # the timer queue, in time order (statebackend.state.timers)
TIMER_KEYS = "_timer_keys"  # the timers of each key (statebackend.state.timers)

# reserved name -> internal kind
INTERNAL_STATES = {TIMERS: "timers", TIMER_KEYS: "timer_keys", TTL_INDEX: "ttl_index"}
INTERNAL_KINDS = tuple(INTERNAL_STATES.values())
