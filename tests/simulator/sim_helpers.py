"""Factories shared by the simulator and planner tests."""

from __future__ import annotations

import numpy as np

from kvflow.perf.hardware import machine
from kvflow.perf.model_shape import ModelShape
from kvflow.perf.perf_model import PerfModel
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
