"""Serving metrics: timings recorded per request (stats.py), exported for Prometheus (prometheus.py)."""
