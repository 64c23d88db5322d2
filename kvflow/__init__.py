"""kvflow: LLM serving built around KV-cache streaming."""

from __future__ import annotations

import os as _os

# Large CPU tensors (weights, prepacked weights, the KV cache) on transparent huge pages: PyTorch's
# CPU allocator madvises allocations of 2 MB and more when THP_MEM_ALLOC_ENABLE is set, and reads
# the variable once, at the process's first large allocation, so it is set here, before torch is
# imported by anything of kvflow's (worker processes import kvflow first too). Decode streams every
# weight and the KV once per step; with 4 KB pages each 4 KB is a TLB miss (a two-level walk in a
# VM), so decode steps run faster on huge pages (docs/results.md, 2026-11-25 kernels). A value the
# user set wins (THP_MEM_ALLOC_ENABLE=0 turns it off); the kernel's THP mode must allow madvise.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
