"""Lifecycle of a job's checkpoints, each a plan first and then its execution: the
registry (what is committed and what each file is referenced by), retention, garbage
collection and savepoints.
"""
