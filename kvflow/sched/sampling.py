"""Sampling parameters (validated) and a request's random state; torch-free at import (the planner and the
simulator need only `SamplingParams`), the batched sampler is `kvflow.sched.sampler`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.sched.admission import InvalidRequest

if TYPE_CHECKING:
    import torch

_GREEDY_EPS = 1e-5


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, as in vLLM/OpenAI.

    temperature 0 means greedy. top_k 0 (or -1), top_p 1 and min_p 0 disable those filters: top_k
    keeps the tokens whose logit is at least the k-th largest (ties included), top_p the smallest
    set of likeliest tokens whose probability reaches top_p, min_p those whose probability is at
    least min_p times the likeliest one's. Penalties (0, 0, 1: off) change the logits before
    anything else, greedy rows included: `repetition_penalty` divides the positive logits (and
    multiplies the negative ones) of every token already in the prompt or the output;
    `frequency_penalty` subtracts itself times the number of times the token was generated,
    `presence_penalty` itself once if it was (OpenAI's definitions; vLLM's order). `seed` makes a
    sampled request reproducible regardless of what else is in the batch. Generation ends at the
    first of: max_tokens generated, an EOS token (unless ignore_eos), a stop token id, or a stop
    string (the stop string itself is not included in the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise InvalidRequest("repetition_penalty", f"must be a number > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest("seed", f"must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", f"must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class SamplerState:
    """Per-request random state: a seeded generator when the request gave a seed."""

    generator: torch.Generator | None = field(default=None)

    @classmethod
    def for_params(cls, params: SamplingParams) -> "SamplerState":
        """A request's state: its own seeded generator, or the one shared state of no generator."""
        if params.greedy or params.seed is None:
            return UNSEEDED
        import torch  # only a seeded request needs it

        g = torch.Generator()
        g.manual_seed(params.seed)
        return cls(g)


UNSEEDED = SamplerState()  # (shared, hence frozen: one per request would be a million in a simulated run)
