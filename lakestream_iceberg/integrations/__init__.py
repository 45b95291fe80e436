"""Integrations with other frameworks, each an optional extra; the core never imports this package.

* :mod:`lakestream_iceberg.integrations.ray` -- a Ray Data ``Datasink`` that publishes training steps exactly once from
  retried write tasks, and the Ray Train side (``pip install 'lakestream-iceberg[ray]'``).
"""
