"""Fixtures of the chaos tests: short lease timing, and a summary section in the report."""

from __future__ import annotations

import pytest

from tests.chaos.harness import TTL_ENV, format_summary

CHAOS_TTL_SECONDS = "3"  # a killed writer blocks the job for about this long
_SUMMARIES: list[dict] = []


@pytest.fixture
def short_leases(monkeypatch) -> float:
    """Leases of this test live CHAOS_TTL_SECONDS (heartbeat: the library's ttl / 4)."""
    monkeypatch.setenv(TTL_ENV, CHAOS_TTL_SECONDS)
    monkeypatch.delenv("CKPT_LEASE_HEARTBEAT_SECONDS", raising=False)
    return float(CHAOS_TTL_SECONDS)


@pytest.fixture
def chaos_report(record_property):
    """Call with a harness summary: printed at the end of the run and kept in the report."""
    def report(summary: dict) -> None:
        _SUMMARIES.append(summary)
        record_property(f"chaos_seed_{summary['seed']}", summary)
    return report


def pytest_terminal_summary(terminalreporter):
    if _SUMMARIES:
        terminalreporter.section("chaos summary (one line per seed)")
        terminalreporter.write_line(format_summary(_SUMMARIES))
        total = sum(s["steps"] for s in _SUMMARIES)
        terminalreporter.write_line(f"{len(_SUMMARIES)} seeds, {total} steps")
