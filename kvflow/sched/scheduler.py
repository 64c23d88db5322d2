"""The one scheduling core: admission, block accounting, preemption, chunked prefill and batch
formation, with the batching policy plugged in. The single-process engine, the pipeline controller
and the simulator are executors of this class; none of them decides what runs next on its own.

    out = scheduler.schedule()        # a batch: which requests, how many tokens, new blocks
    sampled = executor.run(out)       # locally, through worker processes, or with modelled times
    scheduler.update(out, sampled)    # progress, tokens, stop checks, frees

An executor of a pipeline keeps up to `depth` batches in flight: a request belongs to at most one
in-flight batch, so `schedule()` never picks a request whose previous batch has not returned; the
one exception is decode-ahead (`SchedulerConfig.decode_ahead`): a plain greedy decode in flight may be
scheduled once more, at the position after it, with the token its in-flight batch samples as input.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter

from kvflow.kv.manager import KVCacheManager, PrefixHit, blocks_for
from kvflow.sched.config import POLICIES, ROLES, SchedulerConfig  # noqa: F401  (re-exported)
from kvflow.sched.microbatch import MicrobatchPolicy
from kvflow.sched.output import ScheduledSeq, SchedulerOutput  # noqa: F401  (re-exported)
from kvflow.sched.request import FINISHED, RUNNING, WAITING, Request


_seq_request_id = attrgetter("request.request_id")


class Scheduler(MicrobatchPolicy):
    """Decides, each batch, which requests run and how many of their tokens (see module docstring).

    Roles: "both" runs prompts and tokens; "prompt" runs prompts only and hands a request off
    (`take_handoffs`) once its first token is sampled; "token" runs decodes only, its requests come
    in through `add_running` with their KV already in place, and a preempted one is returned to the
    executor (`SchedulerOutput.preempted`) to be recomputed by a prompt scheduler.

    Prefix caching (the pool's, `KVCacheManager`): a waiting request is admitted with the longest
    cached prefix of its tokens counted as computed (whole blocks, never its last token: that one is
    computed again for the logits), so only the rest is prefilled; every returned batch registers
    the full blocks it computed, and a token-role request the blocks its KV arrived in. A preempted
    request finds its own blocks again unless they were evicted meanwhile.

    `admit_hook(request) -> bool`, if given, is asked before a waiting request is admitted (the
    disaggregated executor reserves the token-side blocks the prompt's KV will be streamed into).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int, role: str = "both",
                 admit_hook: Callable[[Request], bool] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config = config
        self.kv_manager = kv_manager  # the block pool (the KV tensors are the executor's)
        self.max_model_len = max_model_len
        self.role = role
        self.admit_hook = admit_hook
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: set[str] = set()  # request ids inside a batch that has not returned
        self.ahead: set[str] = set()  # ... inside two: a decode-ahead batch after the one that samples its input
        self.ahead_seqs = 0  # decode-ahead seqs scheduled so far
        self.handoffs: list[Request] = []
        self.groups: list[list[Request]] = []  # microbatch policy: the fixed microbatches
        self._freed: list[str] = []
        self._full_table: set[str] = set()  # requests whose next batch must carry their whole table
        self._ids = itertools.count()
        self._batches = 0  # scheduled batches not yet returned through update()
        self._loading: set[str] = set()  # waiting requests whose cached prefix is being loaded from disk
        self._swapped = 0  # swapping: batches given a device region so far

    # ------------------------------------------------------------------ admission
    def add(self, request: Request) -> None:
        request.status = WAITING
        self.waiting.append(request)

    def add_front(self, request: Request) -> None:
        """Queue a request to be (re)computed before any other waiting one (preempted elsewhere)."""
        request.status = WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def add_running(self, request: Request) -> None:
        """Token role: a request whose KV (all tokens but the last) is already in this pool's blocks."""
        request.status = RUNNING
        request.num_computed_tokens = len(request.prompt_token_ids) + len(request.output_token_ids) - 1
        if self.kv_manager.prefix_caching:
            self.kv_manager.cache_blocks(request.block_ids, request.token_ids, request.block_hashes, 0, request.num_computed_tokens)
        self.running.append(request)
        self._full_table.add(request.request_id)

    def abort(self, request: Request) -> None:
        """Finish `request`; its blocks are freed now, or when its in-flight batch returns."""
        if request in self.waiting:
            self.waiting.remove(request)
        if not request.is_finished:
            request.finish("abort")
        if request.request_id not in self.in_flight:
            self._remove(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_batches_in_flight(self) -> int:
        return self._batches

    # ------------------------------------------------------------------ the batch
    # Waiting requests (from the front of the queue) whose blocks on disk or on another instance (`kv_source`,
    # tried once) are loaded into the host tier before they are admitted.
    PREFETCH_AHEAD = 8

    def schedule(self) -> SchedulerOutput:
        if self.kv_manager.host is not None:
            self._loading = {r.request_id for r in itertools.islice(self.waiting, self.PREFETCH_AHEAD)
                             if self.kv_manager.prefetch(r.token_ids, r.block_hashes, r.num_tokens - 1, r.take_kv_source())}
        if self.config.policy == "microbatch":
            seqs, preempted = self._schedule_microbatch(), []
        else:
            seqs, preempted = self._schedule_continuous()
        self.in_flight.update(map(_seq_request_id, seqs))
        freed, self._freed = self._freed, []
        region = -1
        if seqs:
            self._batches += 1
            if self.config.swap_regions:
                seqs, region = self._place(seqs)
        return SchedulerOutput(next(self._ids), seqs, preempted, freed, self.kv_manager.take_plan(), region)

    def _place(self, seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], int]:
        """Swapping: the next device region, and each request's blocks laid out in it in order."""
        region = self._swapped % self.config.swap_regions
        self._swapped += 1
        base, out = region * self.config.swap_region_blocks, []
        for s in seqs:
            n = len(s.request.block_ids)
            out.append(s._replace(device_block_ids=tuple(range(base, base + n))))
            base += n
        assert base <= (region + 1) * self.config.swap_region_blocks, "a microbatch larger than its device region"
        return out, region

    def _schedule_continuous(self) -> tuple[list[ScheduledSeq], list[Request]]:
        budget = self.config.max_num_batched_tokens
        cap = self.config.microbatch_size or self.config.max_num_seqs
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        room = self.config.swap_region_blocks if self.config.swap_regions else None  # swapping: a batch fits a region
        bs = self.kv_manager.block_size
        ahead = self.config.decode_ahead and self.role != "prompt"
        if ahead and self._batches >= self.config.max_in_flight:
            # a batch beyond `max_in_flight` of decoding ahead: the decodes in flight that can go ahead,
            # and the rest only beside them (else requests that cannot would split off into batches of
            # their own, alternating with the others: they wait for the next batch, the serial path)
            budget = self._gather_ahead(seqs, budget, cap)
            if not seqs:
                return seqs, preempted
            ahead = False
        for req in list(self.running):
            if budget <= 0 or len(seqs) >= cap:
                break
            if req.request_id in self.in_flight or req.status is not RUNNING:
                continue
            if room is not None:
                n = min(req.num_pending_tokens, budget, self.config.prefill_chunk_size)
                if max(len(req.block_ids), blocks_for(req.num_computed_tokens + n, bs)) > room:
                    continue  # in a later batch (a fresh region)
            s = self._take(req, budget, preempted)
            if s is not None:
                seqs.append(s)
                budget -= s.num_new_tokens
                if room is not None:
                    room -= len(req.block_ids)
        while (self.role != "token" and self.waiting and not preempted and budget > 0 and len(seqs) < cap
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.request_id in self._loading:
                break  # admitted once its prefix is back from disk (the next batch)
            hit = self._match(req)
            n = min(req.num_tokens - hit.num_tokens, budget, self.config.prefill_chunk_size)
            need = req.num_tokens if self.role == "prompt" else hit.num_tokens + n
            if not self.kv_manager.can_ensure(req.block_ids, need, hit):
                break
            if room is not None and blocks_for(need, bs) > room:
                break
            if (self.config.reserve_kv and self.role == "both"
                    and self._reserved_blocks() + self._full_blocks(req) > self.kv_manager.num_blocks):
                break
            if self.admit_hook is not None and not self.admit_hook(req):
                break
            self.waiting.popleft()
            self._admit(req, need, hit)
            s = self._take(req, budget, preempted)
            seqs.append(s)
            budget -= s.num_new_tokens
            if room is not None:
                room -= len(req.block_ids)
        if ahead and not seqs and self._batches:  # a free slot nothing else takes (fewer microbatches than stages)
            self._gather_ahead(seqs, budget, cap)
        return seqs, preempted

    def _gather_ahead(self, seqs: list[ScheduledSeq], budget: int, cap: int) -> int:
        """Append the decode-ahead seqs of requests in flight (in running order) to `seqs`, within the
        token budget and the batch cap; returns the budget left."""
        for req in list(self.running):
            if budget <= 0 or len(seqs) >= cap:
                break
            if req.request_id in self.in_flight and req.status is RUNNING and (s := self._ahead(req)) is not None:
                seqs.append(s)
                budget -= 1
        return budget

    def _take(self, req: Request, budget: int, preempted: list[Request]) -> ScheduledSeq | None:
        """Schedule up to a chunk of `req`'s pending tokens, preempting the newest request that is not
        in flight while blocks are short; None if `req` itself had to be preempted."""
        n = min(req.num_pending_tokens, budget, self.config.prefill_chunk_size)
        before = len(req.block_ids)
        while not self.kv_manager.ensure(req.block_ids, self._blocks_needed(req, n)):
            victim = next((r for r in reversed(self.running) if r.request_id not in self.in_flight), None)
            assert victim is not None, "the request being scheduled is not in flight"
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
        rid = req.request_id
        full = rid in self._full_table
        self._full_table.discard(rid)
        new = self.kv_manager.frozen(req.block_ids) if full else tuple(req.block_ids[before:])
        return ScheduledSeq(req, n, req.num_computed_tokens, new, full)

    def _ahead(self, req: Request) -> ScheduledSeq | None:
        """A decode-ahead seq of `req` (in flight): its next token after the one its batch in flight
        samples, or None where that is not worth it or not exact: it is already decoded ahead,
        its batch in flight does not sample (a prompt chunk), the token sampled there surely ends it
        (max_tokens, the context), its next token is not a plain argmax (sampling, penalties, ids
        banned before min_tokens: the executor samples it), or the token would need a block the pool
        cannot give without preempting (a token that may be discarded preempts nobody)."""
        rid, p = req.request_id, req.params
        n_out = len(req.output_token_ids)
        if (rid in self.ahead or req.num_pending_tokens != 1 or n_out + 1 >= p.max_tokens
                or req.num_tokens + 1 >= self.max_model_len or not p.greedy or p.penalized or n_out < p.min_tokens):
            return None
        before = len(req.block_ids)
        if not self.kv_manager.ensure(req.block_ids, req.num_tokens + 1):
            return None
        self.ahead.add(rid)
        self.ahead_seqs += 1
        full = rid in self._full_table
        self._full_table.discard(rid)
        new = self.kv_manager.frozen(req.block_ids) if full else tuple(req.block_ids[before:])
        return ScheduledSeq(req, 1, req.num_tokens, new, full)

    def _match(self, req: Request) -> PrefixHit:
        """The cached prefix a waiting request starts from: whole blocks, and never all its tokens
        (the last one is computed again to get the logits of the next token, as vLLM does)."""
        return self.kv_manager.match(req.token_ids, req.block_hashes, req.num_tokens - 1)

    def _admit(self, req: Request, num_tokens: int, hit: PrefixHit) -> None:
        """A waiting request starts running: its table takes the hit's blocks (counted as computed)
        and grows to `num_tokens` (the caller checked `can_ensure`); its next batch carries the table."""
        ok = self.kv_manager.ensure(req.block_ids, num_tokens, hit)
        assert ok, "admitted without the blocks it needs"
        req.num_computed_tokens = hit.num_tokens
        req.status = RUNNING
        self.running.append(req)
        self._full_table.add(req.request_id)

    def _full_blocks(self, req: Request) -> int:
        """Blocks `req` holds when it has produced all its tokens (prompt + max_tokens, capped at the context)."""
        return blocks_for(min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len), self.kv_manager.block_size)

    def _reserved_blocks(self) -> int:
        """Blocks the running requests hold or may still take (`reserve_kv`'s admission bound)."""
        return sum(max(self._full_blocks(r), len(r.block_ids)) for r in self.running)

    def _blocks_needed(self, req: Request, n: int) -> int:
        """Tokens `req`'s table must hold to run `n` more. A prompt-role request holds its whole
        prompt from admission on (it leaves after one pass), so a prompt pipeline never preempts."""
        return req.num_tokens if self.role == "prompt" else req.num_computed_tokens + n

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a returned batch: progress, sampled tokens, stop checks; frees what finished.
        Returns the requests that got a token or finished."""
        self.kv_manager.loads_done(out.tiers)
        if out.seqs:
            self._batches -= 1
        changed, gone = [], []
        cache = self.kv_manager.cache_blocks if self.kv_manager.prefix_caching else None
        in_flight, limit, prompt, ahead = self.in_flight, self.max_model_len, self.role == "prompt", self.ahead
        for req, n, start, _, _, _ in out.seqs:  # (a ScheduledSeq's fields)
            rid = req.request_id
            if ahead and rid in ahead:
                ahead.discard(rid)  # its decode-ahead batch (later, in order) is still in flight
            else:
                in_flight.discard(rid)
            if req.status is FINISHED:  # aborted (or finished, decoded ahead) while in flight
                if rid not in in_flight:  # (else its decode-ahead batch writes into its blocks: freed when it returns)
                    gone.append(req)
                changed.append(req)
                continue
            req.num_computed_tokens = start + n
            if cache is not None:
                cache(req.block_ids, req.token_ids, req.block_hashes, start, start + n)
            tok = sampled.get(rid)
            if tok is None:
                continue
            reason = req.append_token(tok, limit)
            if reason is not None:
                req.finish(reason)
                if rid not in in_flight:  # (else as above: the token decoded ahead is discarded, when it returns)
                    gone.append(req)
            elif prompt:  # its KV has been streamed to the token side during this batch
                gone.append(req)
                req.status = WAITING
                self.handoffs.append(req)
            changed.append(req)
        if gone:
            self._release(gone)
            self._drop(gone)
        return changed

    def take_handoffs(self) -> list[Request]:
        """Prompt role: requests whose prompt is done and first token sampled, in order."""
        out, self.handoffs = self.handoffs, []
        return out

    def recompute_all(self) -> list[Request]:
        """The pipeline lost its KV (a worker failed): nothing is in flight any more, and every
        running request loses its blocks and will be recomputed from its prompt and the tokens it
        has produced (queued first, in arrival order; the token role returns them to the executor).
        Requests that were aborted meanwhile are just dropped. Returns the requests to recompute."""
        lost = [r for r in self.running if not r.is_finished]
        for r in self.running:
            if r.block_ids:
                self.kv_manager.release(r.block_ids)
        for r in lost:
            r.num_computed_tokens = 0
            r.status = WAITING
        lost.sort(key=lambda r: r.arrival_time)
        if self.role != "token":
            self.waiting.extendleft(reversed(lost))
        self.running.clear()
        self.groups.clear()
        self.in_flight.clear()
        self.ahead.clear()
        self.handoffs.clear()
        self._full_table.clear()
        self._freed.clear()  # the workers drop every table after a failure (`wire.Fence`)
        self._batches = 0
        return lost

    def rewind(self, resume: dict[str, int]) -> list[Request]:
        """A stage lost its KV and got it back for tokens [0, resume[rid]) (from a replica): nothing
        is in flight any more, every running request keeps its blocks and continues from
        min(its progress, resume) (the rest is recomputed as a prefill chunk, no token is sampled
        again), and its next step carries its whole block table. Requests aborted while in flight
        are removed now; they are returned."""
        gone = [r for r in self.running if r.is_finished]
        for r in gone:
            self._remove(r)
        for r in self.running:
            r.num_computed_tokens = min(r.num_computed_tokens, resume.get(r.request_id, 0))
            self._full_table.add(r.request_id)
        self.in_flight.clear()
        self.ahead.clear()
        self._batches = 0
        return gone

    def fail_all(self) -> list[Request]:
        """Forget every request (the pipeline failed); returns them. Blocks are released."""
        reqs = list(self.waiting) + self.running
        for r in self.running:
            if r.block_ids:
                self.kv_manager.release(r.block_ids)
        self.waiting.clear()
        self.running.clear()
        self.groups.clear()
        self.in_flight.clear()
        self.ahead.clear()
        self._batches = 0
        return reqs

    # ------------------------------------------------------------------ helpers
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release((req,))
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = WAITING
        if self.role != "token":  # (a token scheduler's executor sends it to a prompt scheduler)
            self.waiting.appendleft(req)

    def _remove(self, req: Request) -> None:
        self._drop([req])
        self._release((req,))

    def _drop(self, reqs: list[Request]) -> None:
        """Take `reqs` out of the running list and their microbatches (their blocks are not touched)."""
        gone = set(reqs)  # (a request hashes and compares by identity)
        self.running[:] = [r for r in self.running if r not in gone]
        for g in self.groups:
            if not gone.isdisjoint(g):
                g[:] = [r for r in g if r not in gone]
        self.groups = [g for g in self.groups if g]

    def _release(self, reqs: Sequence[Request]) -> None:
        """Give back the blocks of `reqs`, in order (the executor's workers may forget their tables)."""
        full_table, freed, tables = self._full_table, self._freed, []
        for req in reqs:
            full_table.discard(req.request_id)
            if req.block_ids:
                tables.append(req.block_ids)
                freed.append(req.request_id)
        if tables:
            self.kv_manager.release_all(tables)
