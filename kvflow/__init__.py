"""kvflow: LLM serving built around KV-cache streaming."""

from __future__ import annotations

import os

# OpenMP threads that wait for work sleep instead of spinning (unless the user chose otherwise). Must be
# set before torch loads its OpenMP runtime, hence here. On a machine whose cores are shared (other
# processes, a benchmark peer, the HTTP and tokenizer threads), spinning threads fight the one thread
# still computing: measured on a 2-core AMD EPYC at load 4-6, a 256-token prefill at 2 threads took
# 11.6-12.6 s spinning and 2.4 s sleeping (1 thread: 2.8-3.0 s), the batch-1 decode step 547 ms vs 316 ms.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
