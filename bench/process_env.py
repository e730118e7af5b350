"""The environment of a bench's child processes (job runs, Spark peers, workers).

Loopback Spark, this venv's Python for PySpark workers, the repository importable, and
Python's bytecode cache on (in a folder of its own, outside the tree), as on an
installed deployment: this machine sets ``PYTHONDONTWRITEBYTECODE=1``, which would make
every new process of either engine compile its imports again (about 1 s for ours).
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYCACHE = os.path.join(tempfile.gettempdir(), "ckpt-bench-pycache")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", PYCACHE)
    return env
