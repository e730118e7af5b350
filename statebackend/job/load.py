"""Load a job (or a transform) named by the caller: ``load_job("pkg.module:attr")``.

The reference comes only from the caller (a CLI argument, the deployment's
configuration), never from checkpoint storage: a `_metadata` names no code, and
nothing read from storage is ever imported. The attribute must be a `Job`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

from statebackend.errors import UsageError
from statebackend.job.api import Job

_REF = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
                  r":([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)$")


def is_job_ref(text: str) -> bool:
    """True for ``module.path:attribute`` (the form `load_job` takes)."""
    return bool(_REF.match(text or ""))


def load_job(ref: str) -> Job:
    """Import ``module`` of ``"module:attr"`` and return its `Job` ``attr``."""
    obj = load_object(ref, "job", "examples.user_activity:job")
    if not isinstance(obj, Job):
        raise UsageError(f"job {ref!r} is a {type(obj).__name__}, not a statebackend.job.Job")
    return obj


def load_object(ref: str, what: str, example: str) -> object:
    """Import ``module`` of ``"module:attr"`` and return ``attr`` (``what`` names it in
    errors; ``example`` shows the form)."""
    found = _REF.match(ref or "")
    if found is None:
        raise UsageError(f"{what} {ref!r} is not of the form package.module:attribute "
                         f"(e.g. {example})")
    module_name, attr = found.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(f"{what} {ref!r}: module {module_name!r} not found on the Python "
                             f"path (cwd {os.getcwd()}); install it or set PYTHONPATH") from exc
        raise
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what} {ref!r}: module {module_name!r} has no attribute "
                             f"{attr!r}")
        obj = getattr(obj, part)
    return obj


def module_root(ref: str) -> str | None:
    """The sys.path entry the job's module was imported from (for executors' PYTHONPATH)."""
    module = sys.modules.get(ref.split(":", 1)[0])
    path = getattr(module, "__file__", None)
    if not path:
        return None
    root = os.path.dirname(os.path.abspath(path))
    depth = ref.split(":", 1)[0].count(".")
    if os.path.basename(path) == "__init__.py":
        depth += 1
    for _ in range(depth):
        root = os.path.dirname(root)
    return root
