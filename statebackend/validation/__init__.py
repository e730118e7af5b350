"""Checkpoint validation: tables, Great Expectations suites, reports.

Modules, one job each (Great Expectations is imported only inside functions of
``suites``, so importing this package stays cheap):

- ``manifest``: the manifest-level tables built from the raw ``_metadata`` (parsed
  leniently, so a record the strict parser refuses still yields rows) plus
  storage facts (existence, size, checksum);
- ``content``: ``--deep`` tables from read-only restores of every subtask;
- ``checks``: the registry of job-specific expectations on a state's table;
- ``sampling``: RocksDB's own facts on a column family, and bounded samples (``deep``);
- ``suites``: expectation suites per table, the verdict, and GE runs in an ephemeral
  context;
- ``report``: JSON summary and Data Docs, written under ``reports/chk-<id>/``;
- ``options``: what a validation is asked and what it answers (light);
- ``validate``: the entry point (light); ``runner``: one validation, start to end
  (imported when a validation runs).
"""
