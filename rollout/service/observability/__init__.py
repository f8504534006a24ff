"""What a worker tells its operator: `metrics.py` (Prometheus counters and gauges read from the worker's stats),
`metrics_server.py` (the /metrics endpoint), `tracing.py` (OpenTelemetry spans per group and weight update)."""
