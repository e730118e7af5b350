"""Stand-ins for a state backend: the benches' ceilings, not products.

Each patches this process (a bench's child process or a test's), under the memory
backend's name, so a run is configured as a memory-backend run:

- `drop_all_state` (``no-state``): state that costs nothing and holds nothing. Every
  read finds nothing, every write is dropped, no key-group file is written. On a job
  with timers no timer is ever stored either, so the timers' handler never runs: it
  skips part of the job and is faster than any correct backend could be.
- `keep_state_free` (``free``): state that costs nothing but is kept. A job's value
  states and timers live as Python objects in dicts of this process, one store per
  subtask's local folder: no key or key-group encoding, no codec, no copy, no byte
  keys for timers, no snapshot and no restore (the bench's runs share one process).
  The job runs correctly on it (tests/bench/test_state_stand_ins.py: sessionization
  equals the pandas reference run by run), so what it takes is the job's own work and
  the engine's, beside state that costs nothing. Not a strict bound: the job's code
  runs slower on these long-lived objects than on freshly decoded ones (a sampled
  profile of sessionization: its merge 2.2x, its columns 4.6x the time), though handing
  out fresh copies costs more than it saves.
  It covers a vectorized job's value states (``value``, ``update``, ``clear``) and
  untagged timers (``register``, ``delete``, firing); it refuses any other job, and any
  other call fails, rather than send part of the state to the memory backend.
"""

from __future__ import annotations

from typing import Any


def drop_all_state() -> None:
    """Patch this process's memory backend into the no-state stand-in."""
    from statebackend.state.memory import MemoryStateBackend
    from statebackend.state.memory_table import MemoryTable

    MemoryStateBackend._write_segment = lambda self, prefixes, spare: None
    MemoryStateBackend.record_tables = False  # every state in a (patched) MemoryTable
    MemoryTable.get = lambda self, key: [None] * len(key) if isinstance(key, list) else None
    MemoryTable.write_many = lambda self, puts, deletes=(): None
    MemoryTable.write_columns = lambda self, keys, values: None


def keep_state_free(job: Any) -> None:
    """Patch this process so that ``job``'s state is kept as objects at no cost (module
    docstring); ValueError naming what the stand-in does not cover."""
    import pyarrow as pa

    from statebackend.job import Vectorized, context, core
    from statebackend.state.timer_columns import FIRED_SCHEMA

    handlers = {"logic": job.logic, "on_timer": job.on_timer}
    for what, handler in handlers.items():
        if handler is not None and not isinstance(handler, Vectorized):
            raise ValueError(f"the free stand-in runs vectorized jobs only: {job.name}'s "
                             f"{what} is {type(handler).__name__}")
    for state in job.states:
        if state.kind != "value" or state.ttl is not None:
            raise ValueError(f"the free stand-in keeps value states without a TTL only: "
                             f"{job.name}'s state {state.name!r} is a {state.kind} state"
                             + (" with a TTL" if state.ttl is not None else ""))

    # one store per subtask's local folder (stable across a series' runs): state name ->
    # {key: value}, ("timers", domain) -> {key: set of times}
    stores: dict[str, dict[Any, dict]] = {}

    def table(backend: Any, name: Any) -> dict:
        return stores.setdefault(backend.local_dir, {}).setdefault(name, {})

    def value(self: Any, keys: Any) -> list:
        values = table(self._keys.backend, self.name)
        return [values.get(k) for k in context._key_list(keys)]

    def update(self: Any, keys: Any, new: Any, timestamps: Any = None) -> None:
        table(self._keys.backend, self.name).update(
            zip(context._key_list(keys), new, strict=True))

    def clear(self: Any, keys: Any) -> None:
        values = table(self._keys.backend, self.name)
        for k in context._key_list(keys):
            values.pop(k, None)

    def timer_calls(backend: Any, keys: Any, times: Any, tags: Any, domain: str
                    ) -> tuple[dict, Any]:
        """The domain's timers, and the (key, time) pairs of a register or delete."""
        if tags is not None:
            raise ValueError("the free stand-in keeps untagged timers only")
        ks = context._key_list(keys)
        return (table(backend, ("timers", domain)),
                zip(ks, context._int_list(times, len(ks)), strict=True))

    def drop(timers: dict, key: str, time: int) -> None:
        held = timers.get(key)
        if held is not None:
            held.discard(time)
            if not held:
                del timers[key]

    def register(self: Any, keys: Any, times: Any, tags: Any = None,
                 domain: str = "event") -> None:
        timers, pairs = timer_calls(self.backend, keys, times, tags, domain)
        for k, t in pairs:
            timers.setdefault(k, set()).add(t)

    def delete(self: Any, keys: Any, times: Any, tags: Any = None,
               domain: str = "event") -> None:
        timers, pairs = timer_calls(self.backend, keys, times, tags, domain)
        for k, t in pairs:
            drop(timers, k, t)

    def fire(self: Any, handler: Any, domain: str, up_to: int) -> None:
        """The due timers, time order, to the handler in chunks; a pass per round, so
        timers the handler registers at or below ``up_to`` fire in the next one."""
        timers = table(self.backend, ("timers", domain))
        while True:
            due = sorted((t, k) for k, held in timers.items() for t in held if t <= up_to)
            if not due:
                return
            for t, k in due:
                drop(timers, k, t)
            for lo in range(0, len(due), core.TIMER_BATCH):
                chunk = due[lo:lo + core.TIMER_BATCH]
                n = len(chunk)
                self._handle_timers(handler, pa.table({
                    "key": [k for _, k in chunk], "time": [t for t, _ in chunk],
                    "tag": [None] * n, "domain": [domain] * n, "key_group": [0] * n},
                    schema=FIRED_SCHEMA))

    def uncovered(name: str) -> Any:
        def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
            raise ValueError(f"the free stand-in does not cover {name}")
        return refuse

    context.ValueBatch.value = value
    context.ValueBatch.update = update
    context.ValueBatch.clear = clear
    context.Timers.register = register
    context.Timers.delete = delete
    core.SubtaskProcessor._fire = fire
    for name in ("exists", "insert_absent", "value_columns", "update_columns"):
        setattr(context.ValueBatch, name, uncovered(f"ValueBatch.{name}"))
    context.Timers.list = uncovered("Timers.list")
