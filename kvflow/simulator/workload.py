"""Workloads: request arrival times, prompt lengths and output lengths, as numpy arrays.

Output lengths count every generated token, the first one (produced by the prompt pass) included.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

# LMSys-Chat-1M decode tokens (Vidur, Table 1): median 141, p90 491, mean 215. A lognormal with
# median 141 and p90 491 has sigma = ln(491/141)/z_0.9 and mean 141*exp(sigma^2/2) ~ 226; capping
# at `max_len` brings the mean down toward the published 215.
LMSYS_MEDIAN, LMSYS_P90 = 141.0, 491.0
Z90 = 1.2815515655446004


@dataclass(frozen=True)
class LengthDist:
    """Output-length distribution: 'constant' (value), 'lognormal' (median, p90) or 'lmsys'."""

    kind: str = "lmsys"
    value: int = 0
    median: float = LMSYS_MEDIAN
    p90: float = LMSYS_P90
    max_len: int = 1024

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "lognormal", "lmsys"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "constant" and not 1 <= self.value <= self.max_len:
            raise ValueError("constant length must be in [1, max_len]")
        if self.kind != "constant" and not 1 <= self.median < self.p90:
            raise ValueError("lognormal needs 1 <= median < p90")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant":
            return np.full(n, self.value, dtype=np.int64)
        median, p90 = (LMSYS_MEDIAN, LMSYS_P90) if self.kind == "lmsys" else (self.median, self.p90)
        sigma = math.log(p90 / median) / Z90
        x = rng.lognormal(math.log(median), sigma, n)
        return np.clip(np.rint(x), 1, self.max_len).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    """`n` requests sorted by arrival; lengths are per request. `prompts`, when given, are the
    prompts' token ids (then prompts that share a prefix hit the prefix cache, as they would in a
    server); otherwise every request's prompt is its own."""

    arrival: np.ndarray  # float64 seconds, non-decreasing
    prompt_len: np.ndarray  # int64
    output_len: np.ndarray  # int64, >= 1
    prompts: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if not (len(self.prompt_len) == len(self.output_len) == n):
            raise ValueError("workload arrays must have equal length")
        if self.prompts is not None and [len(p) for p in self.prompts] != self.prompt_len.tolist():
            raise ValueError("workload prompts must have the lengths in prompt_len")
        if n and (np.any(np.diff(self.arrival) < 0) or self.arrival[0] < 0):
            raise ValueError("arrivals must be non-negative and sorted")
        if n and (self.prompt_len.min() < 1 or self.output_len.min() < 1):
            raise ValueError("prompt and output lengths must be >= 1")

    @property
    def n(self) -> int:
        return len(self.arrival)

    @property
    def max_tokens(self) -> int:
        """Longest prompt + output: what a preallocating engine reserves per request."""
        return int((self.prompt_len + self.output_len).max())


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    if rate <= 0:
        raise ValueError("request rate must be positive")
    return np.cumsum(rng.exponential(1.0 / rate, n))


def synthetic(n: int, prompt_len: int, lengths: LengthDist, rate: float | None, seed: int,
              group: int = 1) -> Workload:
    """Fixed-prompt workload; `rate=None` puts every arrival at t=0 (offline makespan runs).

    `group > 1` gives each run of `group` consecutive requests the same output length: DéjàVu's
    Appendix B draws one length per microbatch ("all requests within a microbatch generate the
    same number of tokens").
    """
    if n < 1 or prompt_len < 1 or group < 1:
        raise ValueError("n, prompt_len and group must be >= 1")
    rng = np.random.default_rng(seed)
    out = np.repeat(lengths.sample(rng, -(-n // group)), group)[:n]
    arrival = np.zeros(n) if rate is None else poisson_arrivals(rng, n, rate)
    return Workload(arrival, np.full(n, prompt_len, dtype=np.int64), out)


def azure_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0,
                max_output: int | None = None) -> Workload:
    """Load an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).

    Arrival times are relative to the first row and multiplied by `time_scale` (< 1 compresses).
    """
    stamps, prompts, outs = [], [], []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if limit is not None and i >= limit:
                break
            stamps.append(datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
            prompts.append(max(1, int(row["ContextTokens"])))
            outs.append(max(1, int(row["GeneratedTokens"])))
    if not stamps:
        raise ValueError(f"trace {path} has no rows")
    t = (np.array(stamps) - stamps[0]) * time_scale
    order = np.argsort(t, kind="stable")
    out = np.array(outs, dtype=np.int64)[order]
    if max_output is not None:
        out = np.minimum(out, max_output)
    return Workload(t[order], np.array(prompts, dtype=np.int64)[order], out)
