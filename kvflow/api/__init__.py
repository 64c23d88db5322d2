"""The OpenAI-compatible HTTP API over any `kvflow.serving.backend.Backend`."""
