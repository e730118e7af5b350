"""Rescale-restore: re-split a checkpoint's key groups to a new parallelism, as a plan
(which key groups move where) executed by Spark tasks that commit one new checkpoint.
"""
