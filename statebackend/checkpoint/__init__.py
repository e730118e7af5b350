"""Checkpoints in storage: the layout of a job root, the ``_metadata`` record, the store
(commit, list, load), writer leases, the run ledger, one commit-or-discard attempt,
snapshot (upload) and restore (download), and dumping a checkpoint's rows.

Builds on ``state`` and ``storage``; knows nothing of Spark, Airflow or the CLI.
"""
