"""Latency targets (`SLO`): the one type the load generator (`kvflow.bench`), the simulator and the
planner judge requests by, measured or simulated."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SLO:
    """Time to first token and time per output token, in seconds; None means no target on that metric."""

    ttft: float | None = None
    tpot: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} SLO must be positive, got {v}")

    def met(self, ttft, tpot) -> np.ndarray:
        """Which requests meet both targets, from their TTFTs and TPOTs (arrays, lists or scalars of
        seconds). A time not measured (None or NaN) misses its target; a one-token answer has no time
        per output token: give it a TPOT of 0."""
        ttft, tpot = np.asarray(ttft, dtype=np.float64), np.asarray(tpot, dtype=np.float64)
        ok = np.ones(np.broadcast(ttft, tpot).shape, dtype=bool)
        if self.ttft is not None:
            ok &= ttft <= self.ttft
        if self.tpot is not None:
            ok &= tpot <= self.tpot
        return ok
