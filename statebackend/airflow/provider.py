"""Provider metadata for Airflow (``apache_airflow_provider`` entry point).

Airflow lists this package in ``airflow providers list`` and offers its hook and
operators under the "Checkpoint lifecycle" integration. Importing this module
imports nothing of Airflow or of the library.
"""

from __future__ import annotations

PACKAGE_NAME = "ckpt-lifecycle"  # the distribution name (Airflow checks that they match)
INTEGRATION = "Checkpoint lifecycle"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE_NAME)
    except PackageNotFoundError:
        return "0.0.0"


def get_provider_info() -> dict:
    return {
        "package-name": PACKAGE_NAME,
        "name": INTEGRATION,
        "description": "Stateful PySpark jobs with incremental RocksDB checkpoints: run, "
                       "validate, retain, garbage-collect and rescale-restore them from "
                       "Airflow.",
        "versions": [_version()],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        "operators": [{"integration-name": INTEGRATION,
                       "python-modules": ["statebackend.airflow.operators"]}],
        "hooks": [{"integration-name": INTEGRATION,
                   "python-modules": ["statebackend.airflow.hook"]}],
    }
