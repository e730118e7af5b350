#!/usr/bin/env bash
# Entrypoint of the project image: run Airflow, Spark master/worker or a one-off command.
#   spark-master | spark-worker   Spark standalone from the pip-installed pyspark
#   anything else                 executed as given (airflow ..., python ...)
set -euo pipefail

case "${1:-}" in
  spark-master)
    exec spark-class org.apache.spark.deploy.master.Master \
      --host "${SPARK_MASTER_HOST:-0.0.0.0}" --port 7077 --webui-port 8081
    ;;
  spark-worker)
    exec spark-class org.apache.spark.deploy.worker.Worker "${SPARK_MASTER_URL:?}" \
      --cores "${SPARK_WORKER_CORES:-2}" --memory "${SPARK_WORKER_MEMORY:-2g}" \
      --work-dir /tmp/spark-work
    ;;
  *)
    exec "$@"
    ;;
esac
