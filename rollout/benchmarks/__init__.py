"""`rollout-bench` workloads: each prints a table and, last, one line of JSON."""
