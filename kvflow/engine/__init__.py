"""Single-process engine: requests, scheduler (continuous batching), model runner, sampling, LLM API."""
