"""``<job>_pipeline`` for every job in ckpt_jobs: run_job -> validate -> retain -> gc.

Thin on purpose: the DAG factory of the provider builds it
(`statebackend.airflow.factory.build_pipeline_dag`).
"""

import os

from statebackend.airflow.factory import build_dags

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_jobs.yaml")
globals().update(build_dags(kinds=("pipeline",), default_config=CONFIG))
