"""``<job>_pipeline`` for every job in ckpt_jobs: run_job -> validate -> retain -> gc; and
``<job>_reports``, on the checkpoint Asset the pipeline publishes: its Data Docs.

Thin on purpose: the DAG factory of the provider builds it
(`statebackend.airflow.factory.build_pipeline_dag`).
"""

import os

from statebackend.airflow.factory import build_dags

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_jobs.yaml")
globals().update(build_dags(kinds=("pipeline", "reports"), default_config=CONFIG))
