#!/bin/bash
# airflow-init: migrate the metadata DB, set the admin password, seed sample input.
set -euo pipefail
chown -R airflow /opt/airflow /data
su airflow -s /bin/bash -c "airflow db migrate"
printf '{"admin": "%s"}\n' "${AIRFLOW_ADMIN_PASSWORD}" > /opt/airflow/passwords.json
chown airflow /opt/airflow/passwords.json
chmod 0600 /opt/airflow/passwords.json
# Three days of sample events under /data/events/day=YYYY-MM-DD (the DAG's input pattern).
su airflow -s /bin/bash -c "python -c \"
import os
from jobs.sample_data import generate_days
if not os.path.isdir('/data/events'):
    generate_days('/data/events', 3, events_per_day=20000, n_keys=2000, seed=7)
\""
echo "airflow-init done"
