"""The Checkpoints page: ``data`` reads a job's histories, ``render`` writes the HTML,
``app`` serves it (FastAPI); ``static/`` holds the page's CSS/JS and vendored uPlot
(package data: the wheel ships them). `statebackend.airflow.plugin` registers the app
with Airflow.
"""
