"""Sampling parameters (validated) and the sampler that turns last-token logits into next tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvflow.sched.admission import InvalidRequest

if TYPE_CHECKING:
    from kvflow.sched.request import Request

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, as in vLLM/OpenAI.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. `seed` makes a
    sampled request reproducible regardless of what else is in the batch. Generation ends at the
    first of: max_tokens generated, an EOS token (unless ignore_eos), a stop token id, or a stop
    string (the stop string itself is not included in the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
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


@dataclass
class SamplerState:
    """Per-request random state: a seeded generator when the request gave a seed."""

    generator: torch.Generator | None = field(default=None)

    @classmethod
    def for_params(cls, params: SamplingParams) -> "SamplerState":
        if params.greedy or params.seed is None:
            return cls()
        g = torch.Generator()
        g.manual_seed(params.seed)
        return cls(g)


def sample(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState], banned: list[tuple[int, ...]]) -> list[int]:
    """Next token per row of `logits` [B, V] (float32). `banned[i]`: ids row i may not produce yet (EOS before min_tokens)."""
    assert logits.shape[0] == len(params) == len(states) == len(banned)
    logits = logits.float()
    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, states[i].generator)
    return out


def sample_requests(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Next token of each request from its row of `logits` [len(requests), V], with its own parameters,
    random state and banned ids."""
    return sample(logits, [r.params for r in requests], [r.sampler for r in requests],
                  [r.banned_token_ids() for r in requests])


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())
