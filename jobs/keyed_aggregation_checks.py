"""The keyed-aggregation job's own expectations on its ``totals`` state.

``totals`` is value state with a record codec (count: int64, sum: float64,
min_ts: int64, max_ts: int64), one entry per key. Every stored entry must have
``count >= 1`` (a key is only stored once it has been seen) and
``min_ts <= max_ts``. Registered at import; `statebackend.validate` imports this
module (it is listed in `statebackend.validation.checks.CHECK_MODULES`) and runs
the checks on ``--deep`` validation of any checkpoint whose ``totals`` state has
exactly these record fields; a ``totals`` state of another shape is left alone.
"""

from __future__ import annotations

from statebackend.serialization import RecordCodec
from statebackend.state import StateDescriptor
from statebackend.validation.checks import register_state_checks

STATE_NAME = "totals"
TOTALS_FIELDS = (("count", "int64"), ("sum", "float64"), ("min_ts", "int64"),
                 ("max_ts", "int64"))


def totals_checks(descriptor: StateDescriptor) -> list | None:
    """Expectations over the decoded ``totals`` entries, or None for another shape."""
    codec = descriptor.codec
    if descriptor.kind != "value" or not isinstance(codec, RecordCodec) \
            or set(codec.fields) != set(TOTALS_FIELDS):
        return None
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeBetween(
            column="count", min_value=1, description="every stored key has count >= 1",
            meta={"check": "totals_count_at_least_1", "critical": True}),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="max_ts", column_B="min_ts", or_equal=True,
            description="every stored key has min_ts <= max_ts",
            meta={"check": "totals_min_ts_le_max_ts", "critical": True}),
    ]


register_state_checks(STATE_NAME, totals_checks)
