"""``<job>_rescale_restore`` for every job in ckpt_jobs (manual, typed params).

Thin on purpose: the DAG factory of the provider builds it
(`statebackend.airflow.factory.build_rescale_dag`).
"""

import os

from statebackend.airflow.factory import build_dags

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_jobs.yaml")
globals().update(build_dags(kinds=("rescale",), default_config=CONFIG))
