"""The Checkpoints page: ``data`` reads a job's histories, ``render`` writes the HTML,
``app`` serves it (FastAPI); ``static/`` holds the page's CSS/JS and vendored uPlot.

Airflow's plugin loader imports every ``.py`` file of the plugins folder as a top-level
module of its own name (``app``, ``data``, ...), so ``plugins/.airflowignore`` hides this
package from it; ``plugins/ckpt_plugin.py`` imports it as a package instead.
"""
