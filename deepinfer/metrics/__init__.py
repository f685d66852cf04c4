"""Serving metrics: timings recorded per request (stats.py), exported for Prometheus (prometheus.py,
with the engine core's stats in engine_collector.py and the HTTP middleware in http.py)."""
