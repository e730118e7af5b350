"""Where the JVM state reader's jar is (`statebackend.spark.jvm_reader`): built by
``make jar`` from ``jvm/src`` into this package, shipped in the wheel."""

from __future__ import annotations

import os

JAR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jars", "ckpt-state-reader.jar")


def jar_path() -> str | None:
    """The built jar, or None (``make jar`` builds it; a JDK is needed)."""
    return JAR if os.path.isfile(JAR) else None
