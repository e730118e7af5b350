"""What the read_state tests share: which reader a DataFrame uses."""

from __future__ import annotations


def uses_jvm(df) -> bool:
    """Whether ``df`` reads inside the JVM (`statebackend.spark.jvm_reader`)."""
    return "BatchScan checkpoint state" in df._jdf.queryExecution().executedPlan().toString()
