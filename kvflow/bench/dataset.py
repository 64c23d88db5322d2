"""What the load generator sends: prompts (synthetic token ids or an Azure trace), output lengths and arrival times.

Lengths and Poisson arrivals come from `kvflow.simulator.workload` (its LMSys-Chat-like lognormal:
median 141, p90 491 output tokens, after Vidur's Table 1). One seed fixes everything; every rate
of a sweep replays the same requests with inter-arrival gaps divided by the rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.simulator.workload import LengthDist, azure_trace, poisson_arrivals

MAX_REQUESTS = 100_000


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # sent with ignore_eos, so exactly this many tokens are generated
    arrival: float  # seconds after the start of the run


@dataclass(frozen=True)
class DatasetSpec:
    """`trace` None: synthetic prompts of `prompt_len` random token ids; else rows of an Azure trace CSV.

    `output` None means LMSys-like for synthetic prompts and the trace's GeneratedTokens for a trace.
    Lengths are multiplied by `length_scale` (trace prompts) / `output_scale` (outputs), then capped
    by `max_output_len` and by the context. `trace_arrivals` keeps the trace's timing, stretched to
    each rate's mean; otherwise arrivals are Poisson.
    """

    num_requests: int = 100
    prompt_len: int = 256
    output: LengthDist | None = None
    output_scale: float = 1.0
    max_output_len: int | None = None
    trace: Path | None = None
    length_scale: float = 1.0
    trace_arrivals: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests must be in [1, {MAX_REQUESTS}], got {self.num_requests}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_scale <= 0 or self.length_scale <= 0:
            raise ValueError("output_scale and length_scale must be positive")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError(f"max_output_len must be >= 1, got {self.max_output_len}")
        if self.trace is not None and not Path(self.trace).is_file():
            raise FileNotFoundError(f"trace file {self.trace} not found")
        if self.trace_arrivals and self.trace is None:
            raise ValueError("trace_arrivals needs a trace file")
        if self.seed < 0:
            raise ValueError("seed must be non-negative")


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(x * scale)).astype(np.int64)


def build_requests(spec: DatasetSpec, rate: float, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """The requests of one run at `rate` req/s (same prompts and lengths for every rate)."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    if spec.trace is not None:
        w = azure_trace(spec.trace, limit=n)
        prompt_len = np.minimum(_scaled(w.prompt_len, spec.length_scale), max_model_len - 1)
        out = w.output_len if spec.output is None else spec.output.sample(rng, len(prompt_len))
        n = len(prompt_len)
    else:
        if spec.prompt_len >= max_model_len:
            raise ValueError(f"prompt_len {spec.prompt_len} leaves no room in the context of {max_model_len} tokens")
        prompt_len = np.full(n, spec.prompt_len, dtype=np.int64)
        out = (spec.output or LengthDist("lmsys")).sample(rng, n)
    out = _scaled(out, spec.output_scale)
    if spec.max_output_len is not None:
        out = np.minimum(out, spec.max_output_len)
    out = np.minimum(out, max_model_len - prompt_len)
    gaps_rng = np.random.default_rng(spec.seed + 1)
    if spec.trace_arrivals:
        t = azure_trace(spec.trace, limit=n).arrival
        mean_rate = n / t[-1] if t[-1] > 0 else rate
        arrival = t * (mean_rate / rate)
    else:
        arrival = poisson_arrivals(gaps_rng, n, 1.0) / rate
        arrival -= arrival[0]  # the first request goes out at once
    lo = min(max(vocab_size // 8, 1), vocab_size - 1)  # skip the low ids, where special tokens live
    prompts = [rng.integers(lo, vocab_size, int(p)).tolist() for p in prompt_len]
    return [BenchRequest(p, int(o), float(a)) for p, o, a in zip(prompts, out, arrival)]
