"""One request's whole state (tokens, KV block table, progress, stop logic) and the output it reports."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

from kvflow.sched.sampling import UNSEEDED, SamplerState, SamplingParams
from kvflow.model.tokenizer import IncrementalDetokenizer

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds blocks; prompt partly or fully computed
    FINISHED = "finished"


# The members as plain names: reading one off the class costs ~0.1 µs in Python 3.11 (a descriptor),
# and a simulated run reads them millions of times.
WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What a request produced so far. `new_token_ids`/`new_text` are the delta since the last report."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class TokenIds(Sequence[int]):
    """A request's prompt followed by its output tokens, read-only, over the request's own two lists
    (neither is copied: a prompt of thousands of tokens costs nothing per request, and a sampled
    token is appended once). A slice is a new list; so is anything else that needs one (`list(t)`)."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        prompt, output = self.prompt, self.output
        p = len(prompt)
        if i.__class__ is slice:
            start, stop = i.start, i.stop
            if i.step is not None or start is None or stop is None or start < 0 or stop < 0:
                start, stop, step = i.indices(p + len(output))
                if step != 1:
                    return list(self)[i]
            if start >= p:
                return output[start - p:stop - p] if stop > p else []
            if stop <= p:
                return prompt[start:stop]
            return prompt[start:] + output[:stop - p]
        if i < 0:
            i += p + len(output)
        if i < 0:
            raise IndexError("token index out of range")
        return prompt[i] if i < p else output[i - p]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prompt, self.output)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (TokenIds, list, tuple)) and len(self) == len(other) and all(
            a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    detokenizer: IncrementalDetokenizer | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of token_ids' full blocks, as far as computed
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # the URL of another instance holding this prompt's KV (the router's prefill instance): pulled from once
    # before admission, into the host tier (`KVCacheManager.prefetch`); what it no longer holds is recomputed
    kv_source: str | None = None
    _reported_tokens: int = 0
    _reported_text: int = 0
    # (slotted: a simulated run holds ~100,000 requests at once and makes millions)
    sampler: SamplerState = field(init=False, repr=False)
    _max_stop_len: int = field(init=False, repr=False)
    _token_ids: TokenIds | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        params = self.params
        self.sampler = UNSEEDED if params.seed is None else SamplerState.for_params(params)
        self._max_stop_len = max(map(len, params.stop)) if params.stop else 0

    @property
    def token_ids(self) -> TokenIds:
        """The prompt followed by the output, what the model consumes (made on first use: a simulated
        request without prefix caching never reads it)."""
        t = self._token_ids
        if t is None:
            t = self._token_ids = TokenIds(self.prompt_token_ids, self.output_token_ids)
        return t

    def take_kv_source(self) -> str | None:
        """`kv_source`, once: one pull, and what it does not bring is recomputed."""
        source, self.kv_source = self.kv_source, None
        return source

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to be run through the model before the next one can be sampled."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED

    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids this request may not produce at its next step (stop/EOS ids before min_tokens)."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        return tuple(set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(self.eos_token_ids)))

    def append_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Record a sampled token; returns why the request should finish now, if it should."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        n_out = len(self.output_token_ids)
        p = self.params
        if n_out >= p.min_tokens:
            if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
                return "stop"
        if self.detokenizer is not None:
            before = len(self.text)
            self.text += self.detokenizer.add(token_id)
            if self._max_stop_len and n_out >= p.min_tokens:
                start = max(0, before - self._max_stop_len + 1)
                hits = [i for i in (self.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    return "stop"
        if n_out >= p.max_tokens or len(self.prompt_token_ids) + n_out >= max_model_len:
            return "length"
        return None

    def steps_to_length(self, token_id: int, max_model_len: int) -> int | None:
        """If every next token is `token_id`: after how many more `append_token` calls the request
        finishes ("length"); None when it might stop before that (`token_id` is a stop or EOS id,
        or stop strings are checked on text)."""
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            return None
        if self.detokenizer is not None:
            return None
        n_out = len(self.output_token_ids)
        left = min(p.max_tokens - n_out, max_model_len - len(self.prompt_token_ids) - n_out)
        return left if left > 1 else 1

    def extend_tokens(self, tokens: list[int]) -> None:
        """`append_token` of each of `tokens` in turn, none of which finishes the request
        (`steps_to_length` said so)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids += tokens

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.monotonic()

    def take_output(self) -> RequestOutput:
        """A snapshot with the delta since the previous call (text held back while a stop string may be forming)."""
        visible = len(self.text)
        if not self.is_finished and self._max_stop_len:
            visible = max(self._reported_text, visible - self._max_stop_len + 1)
        new_ids = self.output_token_ids[self._reported_tokens :]
        new_text = self.text[self._reported_text : visible]
        self._reported_tokens = len(self.output_token_ids)
        self._reported_text = visible
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            text=self.text[:visible],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            error=self.error,
        )
