"""Iteration-level (continuous) batching with chunked prefill, a KV block budget and preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvflow.engine.request import Request, RequestStatus
from kvflow.kv.manager import KVCacheManager, blocks_for


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_batched_tokens: tokens one step may process (decodes + prompt chunks);
    prefill_chunk_size: most prompt tokens one request gets per step; max_num_seqs: running cap."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk_size: int = 512

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"SchedulerConfig.{key} must be positive, got {getattr(self, key)}")


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the request's KV covers all its tokens, so a next token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def check_admissible(request: Request, max_model_len: int, kv: KVCacheManager) -> None:
    """Raise ValueError for a request that could never run (too long for the context or the cache)."""
    total = request.num_prompt_tokens + request.params.max_tokens
    if request.num_prompt_tokens == 0:
        raise ValueError("prompt is empty")
    if request.num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; the context length is {max_model_len}")
    if total > max_model_len:
        raise ValueError(
            f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) = {total} "
            f"exceeds the context length {max_model_len}"
        )
    need = blocks_for(total, kv.block_size)
    if need > kv.num_blocks:
        raise ValueError(
            f"request needs up to {need} KV blocks ({total} tokens) but the cache has only "
            f"{kv.num_blocks} ({kv.capacity_tokens} tokens); raise the KV cache size"
        )


class Scheduler:
    """Decides, each step, which requests run and how many of their tokens.

    Policy (as vLLM v1): running requests first, in arrival order, each taking its pending tokens
    (1 when decoding, a bounded chunk while its prompt is processed); then waiting requests are
    admitted FCFS while the token budget, the sequence cap and free KV blocks allow. When a running
    request needs a block and none is free, the most recently admitted running request is
    preempted: its blocks are freed and it is recomputed later from its prompt and output so far.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ admission
    def check_admissible(self, request: Request) -> None:
        check_admissible(request, self.max_model_len, self.kv)

    def add(self, request: Request) -> None:
        self.check_admissible(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.finish("abort")

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk_size
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending_tokens, budget, chunk)
            while not self.kv.ensure(req.block_ids, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            seqs.append(ScheduledSeq(req, n))
            budget -= n
            i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_pending_tokens, budget, chunk)
            if not self.kv.ensure(req.block_ids, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(ScheduledSeq(req, n))
            budget -= n
        return SchedulerOutput(seqs, preempted)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress after the model ran; returns requests that changed (got a token or finished)."""
        changed = []
        for s in out.seqs:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            reason = req.append_token(tok, self.max_model_len)
            if reason is not None:
                self.running.remove(req)
                self._release(req)
                req.finish(reason)
            changed.append(req)
        return changed

    # ------------------------------------------------------------------ helpers
    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.kv.release(req.block_ids)
