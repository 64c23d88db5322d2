"""The one admission check of every mode: whether a request could ever run (a prompt of valid token
ids that leaves room in the context for max_tokens, and KV that fits the pools), and the structured
error it raises. The engine and the controller call `validate` when a request is submitted; the
HTTP API calls the same checks before it submits one, and answers an `InvalidRequest` as a 400
whose `param` is the error's `field`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.kv.manager import KVCacheManager, blocks_for

if TYPE_CHECKING:
    from kvflow.sched.request import Request
    from kvflow.sched.sampling import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequest(ValueError):
    """Bad input about one request. `field`: the request field at fault ("prompt", "max_tokens", any
    `SamplingParams` field), or None for the request as a whole; `reason`: what is wrong with it;
    `code`: a machine-readable reason, or None. The message is the field followed by the reason
    ("top_p must be in (0, 1], got 2")."""

    def __init__(self, field: str | None, reason: str, code: str | None = None) -> None:
        self.field, self.reason, self.code = field, reason, code
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.field} {self.reason}" if self.field else self.reason

    def about(self, field: str) -> "InvalidRequest":
        """The same error about the field the client calls `field` (the chat API's
        max_completion_tokens is `SamplingParams.max_tokens`)."""
        return InvalidRequest(field, self.reason, self.code)


@dataclass(frozen=True)
class Limits:
    """What every request must fit: the context length and the KV pool(s) it will occupy."""

    max_model_len: int
    vocab_size: int | None = None
    max_blocks: int | None = None  # most blocks one request may hold (swapping: a device region)


def check_prompt(token_ids: Sequence[int], limits: Limits) -> None:
    """A prompt is non-empty, of token ids in the vocabulary, and leaves room for a token."""
    if not token_ids:
        raise InvalidRequest("prompt", "is empty")
    if limits.vocab_size is not None:
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < limits.vocab_size)]
        if bad:
            raise InvalidRequest("prompt", f"has token ids out of range [0, {limits.vocab_size}): {bad[:5]}")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidRequest("prompt", f"has {len(token_ids)} tokens, leaving no room to generate: this model's "
                             f"maximum context length is {limits.max_model_len} tokens", CONTEXT_LENGTH_EXCEEDED)


def check_params(params: SamplingParams, prompt_len: int, limits: Limits) -> None:
    """The prompt's `prompt_len` tokens and max_tokens fit the context; stop token ids are in the vocabulary."""
    total = prompt_len + params.max_tokens
    if total > limits.max_model_len:
        raise InvalidRequest("max_tokens", f"({params.max_tokens}) + the prompt ({prompt_len} tokens) = {total} exceeds "
                             f"this model's maximum context length of {limits.max_model_len} tokens",
                             CONTEXT_LENGTH_EXCEEDED)
    if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in params.stop_token_ids):
        raise InvalidRequest("stop_token_ids", f"must be token ids in [0, {limits.vocab_size}), "
                             f"got {list(params.stop_token_ids)}")


def validate(request: Request, limits: Limits, pools: list[KVCacheManager]) -> None:
    """Raise `InvalidRequest` for a request that could never run."""
    check_prompt(request.prompt_token_ids, limits)
    check_params(request.params, request.num_prompt_tokens, limits)
    total = request.num_prompt_tokens + request.params.max_tokens
    if limits.max_blocks is not None and pools and blocks_for(total, pools[0].block_size) > limits.max_blocks:
        raise InvalidRequest(None, f"the request needs up to {blocks_for(total, pools[0].block_size)} KV blocks ({total} "
                             f"tokens) but a device region of the swapping pipeline holds {limits.max_blocks}; "
                             "raise the KV cache size")
    for kv in pools:
        need = blocks_for(total, kv.block_size)
        if need > kv.num_blocks:
            raise InvalidRequest(None, f"the request needs up to {need} KV blocks ({total} tokens) but the cache has "
                                 f"only {kv.num_blocks} ({kv.capacity_tokens} tokens); raise the KV cache size")
