"""The single-process executor of the one scheduler: model runner, LLMEngine, and the offline LLM API."""
