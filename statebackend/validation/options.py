"""What one validation is asked (`ValidationOptions`) and what it answers
(`ValidationResult`); the levels and report modes (`statebackend.validation.validate`).

Light on purpose: no pandas, pyarrow or RocksDB, so the CLI, the Airflow steps and
the Checkpoints page build options and read results without loading the checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statebackend.errors import UsageError
from statebackend.state.external_store import ExternalStore

if TYPE_CHECKING:
    from statebackend.validation.checks import StateCheck

REPORT_NOW = "now"    # verdict, then Data Docs rendered by GE in the same call
REPORT_NONE = "none"  # verdict only (summary.json + overview page): GE is not imported
REPORT_MODES = (REPORT_NOW, REPORT_NONE)
LEVEL_MANIFEST, LEVEL_DEEP, LEVEL_FULL = "manifest", "deep", "full"
LEVELS = (LEVEL_MANIFEST, LEVEL_DEEP, LEVEL_FULL)


@dataclass(frozen=True)
class ValidationOptions:
    """How one validation runs; refused in one line when a value is not valid.

    ``level``: "manifest", "deep" or "full" (`statebackend.validation.validate`).
    ``sample``: entries checked one by one per column family and subtask at "deep"
    (default `sampling.DEFAULT_SAMPLE`); ``seed``: the sample's seed (default random;
    the summary records it, so a run can be repeated). ``report``: "now" renders GE
    Data Docs after the verdict, "none" skips them. ``report_dir``: the report goes to
    ``DIR/chk-<id>/`` instead of the checkpoint storage; ``work_dir``: where subtasks
    are restored (default: temp folders). ``state_checks`` maps a state name to a job
    check (`statebackend.validation.checks`); it adds to / overrides the registered
    ones. ``state_db``: the database of an external-backend checkpoint (its content is
    read from there).
    """

    level: str = LEVEL_MANIFEST
    sample: int | None = None
    seed: int | None = None
    report: str = REPORT_NOW
    report_dir: str | None = None
    work_dir: str | None = None
    state_checks: Mapping[str, StateCheck] | None = field(default=None, compare=False)
    state_db: ExternalStore | None = None  # an external-backend checkpoint's database

    def __post_init__(self) -> None:
        if self.report not in REPORT_MODES:
            raise UsageError(f"report mode {self.report!r} is invalid: use one of "
                             f"{', '.join(REPORT_MODES)}")
        if self.level not in LEVELS:
            raise UsageError(f"validation level {self.level!r} is invalid: use one of "
                             f"{', '.join(LEVELS)}")
        if self.sample is not None and (isinstance(self.sample, bool)
                                        or not isinstance(self.sample, int) or self.sample < 1):
            raise UsageError(f"sample {self.sample!r} is invalid: give a number of "
                             "entries >= 1")

    @property
    def deep(self) -> bool:
        """True at the content levels ("deep", "full"): subtasks are restored."""
        return self.level != LEVEL_MANIFEST


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of one validation; ``summary`` is the JSON summary that was stored."""

    success: bool
    checkpoint_id: int
    summary: dict = field(compare=False)
    report_location: str
    data_docs_index: str | None
    report_index: str | None = None  # the self-contained overview page (works offline)

    @property
    def failed_checks(self) -> list[str]:
        return list(self.summary.get("failed_checks", []))

    def to_json(self) -> dict:
        return self.summary
