"""Fixtures for the job tests: a Spark standalone cluster on 127.0.0.1 (master + 2 workers)."""

from __future__ import annotations

import os

import pytest

from bench.standalone import standalone_cluster as start_cluster


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory):
    """Master + 2 workers (1 core, 1 GB each) from the pip pyspark, stopped by PID."""
    with start_cluster(str(tmp_path_factory.mktemp("cluster"))) as cluster:
        yield cluster
