"""kvflow: LLM serving built around KV-cache streaming."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kvflow` (CLI start-up, planner, simulator) does not pull in torch.
    if name == "LLM":
        from kvflow.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvflow.sched.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
