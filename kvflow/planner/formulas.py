"""DéjàVu Appendix D: memory lower bounds on pipeline depth (eqs. 2, 3), inverse throughputs of
the colocated (eq. 4) and disaggregated pipelines, the condition under which disaggregation wins
(eq. 5), the throughput-balancing split (eqs. 6, 7), and the streaming overhead factor m.

Notation (per the paper): D machines; Y and t are the per-stage prompt and token-step times of
one microbatch when the model is split over all D machines; N tokens generated per microbatch;
m >= 1 the prompt-side slowdown from streaming its KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class Infeasible(ValueError):
    """The model (or its KV cache) cannot fit in the memory given."""


def min_prompt_depth(layers: int, layer_weight: float, prompt_kv: float, memory: float) -> int:
    """Eq. 2: D_p >= ceil(L (C0 + W0) / M). `prompt_kv` = C0, one layer's prompt KV of a microbatch."""
    if layer_weight + prompt_kv > memory:
        raise Infeasible("one layer's weights and prompt KV exceed a machine's memory")
    return math.ceil(layers * (prompt_kv + layer_weight) / memory)


def min_token_depth(layers: int, layer_weight: float, prompt_kv: float, token_kv: float, memory: float) -> int:
    """Eq. 3: D_t >= L W0 / (M - L (C0 + K0)), rounded up. K0 is one layer's generated-token KV
    of a microbatch; every stage holds the KV of all D_t in-flight microbatches for its layers."""
    free = memory - layers * (prompt_kv + token_kv)
    if free <= 0:
        raise Infeasible("the KV cache of the in-flight microbatches alone exceeds a machine's memory")
    return max(1, math.ceil(layers * layer_weight / free))


def colocated_inverse_throughput(d: int, y: float, t: float, n: float) -> float:
    """Eq. 4: I_c = (D-1)(Y-t)/D + Y + N t, seconds per microbatch of a D-stage colocated pipeline."""
    return (d - 1) * (y - t) / d + y + n * t


def token_inverse_throughput(d: int, d_t: float, t: float, n: float) -> float:
    """I_t = N t_dis = N D t / D_t."""
    return n * d * t / d_t


def prompt_inverse_throughput(d: int, d_p: float, y: float, m: float) -> float:
    """I_p = m Y_dis = m D Y / D_p."""
    return m * d * y / d_p


def streaming_overhead(stream_s: float, prompt_stage_s: float) -> float:
    """m = max(1, KV transfer time / prompt time) (Appendix H.4), both per stage: each prompt stage
    streams its layers' KV (`PerfModel.kv_transfer_time`) while it computes them, so only the part
    that does not fit behind its compute slows the prompt pipeline."""
    if prompt_stage_s <= 0:
        raise ValueError("prompt time must be positive")
    return max(1.0, stream_s / prompt_stage_s)


def disaggregation_threshold(d: int, m: float) -> float:
    """Eq. 5's right-hand side: disaggregation beats colocation iff Y/t > (D-1)/(D(2-m)-1).
    Returns +inf when no Y/t suffices (m >= 2 - 1/D, e.g. a single machine or slow streaming)."""
    denom = d * (2 - m) - 1
    return math.inf if denom <= 0 else (d - 1) / denom


@dataclass(frozen=True)
class Split:
    """Eqs. 6-7 (`d_t`, `d_p` real-valued) and the best integer split with both sides >= 1."""

    d_t: float
    d_p: float
    token_machines: int
    prompt_machines: int
    inverse_throughput: float  # max(I_t, I_p) of the integer split


def balanced_split(d: int, y: float, t: float, n: float, m: float, min_p: int = 1, min_t: int = 1) -> Split:
    """Eqs. 6, 7: D_t = D N t / (m Y + N t), D_p = D m Y / (m Y + N t); then the integer split
    (D_p + D_t = D, each at least its memory bound) that minimises max(I_t, I_p)."""
    if min_p + min_t > d:
        raise Infeasible(f"{d} machines cannot hold a prompt pipeline of {min_p} and a token pipeline of {min_t}")
    d_t = d * n * t / (m * y + n * t)
    best = min(range(min_p, d - min_t + 1),
               key=lambda p: (max(token_inverse_throughput(d, d - p, t, n), prompt_inverse_throughput(d, p, y, m)),
                              abs(p - (d - d_t))))
    inv = max(token_inverse_throughput(d, d - best, t, n), prompt_inverse_throughput(d, best, y, m))
    return Split(d_t, d - d_t, d - best, best, inv)
