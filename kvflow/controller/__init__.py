"""The controller: an executor of the one scheduler over pipelines of worker processes (batch queue, KV hand-off plans, liveness)."""
