"""Factories shared by the simulator and planner tests."""

from __future__ import annotations

import numpy as np

from kvflow.perf.hardware import machine
from kvflow.perf.model_shape import ModelShape
from kvflow.perf.perf_model import BatchShape, PerfModel
from kvflow.simulator.workload import Workload

TINY = ModelShape("tiny", layers=8, hidden=64, heads=4, kv_heads=4, head_dim=16, intermediate=128, vocab=100)


class ConstantPerf(PerfModel):
    """Stage times that do not depend on batch or length; free activation hops."""

    def __init__(self, y: float, t: float, link_gbps: float = 100.0) -> None:
        super().__init__(TINY, machine("1xA100-80GB", link_gbps=link_gbps))
        self.y, self.t = y, t

    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        return self.y

    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        return self.t

    def hop_time(self, batch: int, tokens: int) -> float:
        return 0.0


def workload(arrival, out, prompt: int = 10) -> Workload:
    arrival = np.asarray(arrival, dtype=float)
    return Workload(arrival, np.full(len(arrival), prompt, dtype=np.int64), np.asarray(out, dtype=np.int64))


def paced_seconds(shape: BatchShape, pace: float = 1.0) -> float:
    """The step-time function of the same-decisions test: what every stage of a pipeline takes for
    one batch, in the simulator and (slept before computing) in the paced worker processes; `pace`
    scales it (a timeline `pace` times as long, with the same order of events)."""
    t = 0.0
    if shape.prefill_seqs:
        t += 0.060 + 0.001 * shape.prefill_tokens
    if shape.decode_seqs:
        t += 0.170 + 0.017 * shape.decode_seqs
    return pace * t


class PacedPerf(PerfModel):
    """`paced_seconds` per stage, free activation hops, a link fast enough that KV arrives at once."""

    def __init__(self, pace: float = 1.0) -> None:
        super().__init__(TINY, machine("1xA100-80GB", link_gbps=1e6))
        self.pace = pace

    def step_time(self, batch: BatchShape, depth: int) -> float:
        return paced_seconds(batch, self.pace)

    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        return paced_seconds(BatchShape(batch, batch * prompt_len, batch * prompt_len * prompt_len), self.pace)

    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        return paced_seconds(BatchShape(decode_seqs=batch, decode_context=batch * context_len), self.pace)

    def hop_time(self, batch: int, tokens: int) -> float:
        return 0.0
