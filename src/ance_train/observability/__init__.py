"""What the services report: Prometheus metrics, AnceRun status and Events, run tracking."""
