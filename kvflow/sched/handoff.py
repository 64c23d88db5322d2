"""Disaggregation's hand-off between a prompt pipeline's scheduler and a token pipeline's.

A request is admitted by a prompt scheduler only once blocks for its KV are reserved in a token
pipeline's pool (`reserve`, the prompt scheduler's admission hook). Its prompt pass streams the KV
there (`kv_sent`); its first token is sampled on the prompt side (`Scheduler.take_handoffs`). It
joins the token scheduler (running, or a token microbatch's ready queue) when both have happened;
a request that finished at its first token, or was aborted, gives its reservation back once no KV
is still on its way into it (`settle`). The controller and the simulator are the two executors of
these decisions; what differs is only how they learn that KV has arrived (a worker's `KVArrived`
per token stage, or the simulated link's completion time).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple, Protocol

from kvflow.kv.manager import NO_HIT, KVCacheManager
from kvflow.sched.request import Request
from kvflow.sched.scheduler import ScheduledSeq, Scheduler


class KVStream(NamedTuple):
    """Tokens [start, end) of a prompt's KV (of `total` tokens) that a prompt batch streams into the
    token-side blocks `dest_blocks`; tokens [0, cached) are a token-side prefix-cache hit. (A named
    tuple: one is made per request, and a simulated run makes millions.) `dest_blocks` is the
    reservation's table itself, not a copy (one of ~100 blocks per request): a driver reads it as
    the batch is dispatched (the controller encodes it into the step then); it later becomes the
    request's table on the token side, and is emptied when the blocks are given back."""

    rid: str
    start: int
    end: int
    total: int
    dest_blocks: list[int]
    cached: int


class TokenSide(Protocol):
    """A token pipeline as the hand-off sees it."""

    sched: Scheduler
    kv_manager: KVCacheManager
    ready: deque  # microbatch policy: requests whose KV is in place, waiting for a microbatch slot

    @property
    def depth(self) -> int: ...

    @property
    def microbatch(self) -> int: ...


class Handoff:
    """The hand-off state of one disaggregated deployment (any number of token pipelines)."""

    def __init__(self, token: Sequence[TokenSide]) -> None:
        if not token:
            raise ValueError("a hand-off needs at least one token pipeline")
        self.token = list(token)
        self.tables: dict[str, tuple[TokenSide, list[int]]] = {}  # token-side blocks reserved per request
        self.cached: dict[str, int] = {}  # of those, tokens [0, n) a token-side prefix-cache hit holds
        self.pending: dict[str, set[Hashable]] = {}  # request -> parts of its KV still on their way
        self.parked: dict[str, Request] = {}  # sampled (or finished) while its KV is on its way
        self.joined: dict[str, TokenSide] = {}  # microbatch policy: the ready queue a request waits in
        self.refusals = 0  # admissions `reserve` refused (no token pool had room)
        self._target: tuple[TokenSide | None, int] = (None, 0)
        self._number = {id(tp): i for i, tp in enumerate(self.token)}
        self._heap: list[tuple[int, int]] = []  # (-free blocks, number): at least each pool's count, maybe more
        self._freed: set[int] = set(range(len(self.token)))  # pools whose count may have grown since pushed

    # --- prompt side --------------------------------------------------------------------------

    def reserve(self, req: Request) -> bool:
        """Prompt admission: make the token-side blocks for `req`'s tokens so far, starting with the
        token pool's own cached prefix of it (prefix caching), whose KV is then not streamed.
        Consecutive admissions go to one token pipeline, a token microbatch's worth at a time, then
        to the one with the most free blocks."""
        rid = req.request_id
        entry = self.tables.get(rid)
        if entry is not None and entry[1]:
            if entry[0].kv_manager.ensure(entry[1], self._tokens(entry[0], req)):
                return True
            self.refusals += 1
            return False
        if entry is None:
            tp, count = self._target
            tokens = self._tokens(tp, req) if tp is not None and count < tp.microbatch else -1
            if tokens < 0 or not tp.kv_manager.can_ensure([], tokens):
                tp, count = self._freest(), 0
                tokens = self._tokens(tp, req)
            self._target = (tp, count + 1)
            entry = self.tables[rid] = (tp, [])
        else:
            tokens = self._tokens(entry[0], req)
        tp, table = entry
        kv = tp.kv_manager
        hit = kv.match(req.token_ids, req.block_hashes, len(req.prompt_token_ids) + len(req.output_token_ids)) \
            if kv.prefix_caching else NO_HIT
        if not kv.ensure(table, tokens, hit):
            self.refusals += 1
            return False
        self.cached[rid] = hit.num_tokens
        return True

    def freed(self, tp: TokenSide) -> None:
        """Blocks of `tp`'s pool were given back (a request finished or was preempted there): the
        executor says so wherever that happens outside the hand-off, which picks the freest pool."""
        self._freed.add(self._number[id(tp)])

    def _freest(self) -> TokenSide:
        """The token pipeline with the most free blocks, the first of them on a tie. A heap of counts
        as last seen: a pool's count only grows through `freed`, where it is pushed again, so each
        pool's largest entry is at least its count, and a top entry that still holds is the answer."""
        heap, token = self._heap, self.token
        if len(heap) > 4 * len(token) + 64:
            heap.clear()
            self._freed.update(range(len(token)))
        for i in self._freed:
            heapq.heappush(heap, (-token[i].kv_manager.num_free_blocks, i))
        self._freed.clear()
        while True:
            free, i = heap[0]
            now = token[i].kv_manager.num_free_blocks
            if -free == now:
                return token[i]
            heapq.heapreplace(heap, (-now, i))  # it took blocks since: its entry goes down to its count

    @staticmethod
    def _tokens(tp: TokenSide, req: Request) -> int:
        """Tokens of `req` to reserve in `tp`: what it holds now; with the microbatch policy every
        token it may ever hold (a token microbatch never grows its tables, as the policy reserves a
        request's whole KV up front)."""
        if tp.sched.config.policy == "microbatch":
            return len(req.prompt_token_ids) + max(len(req.output_token_ids), req.params.max_tokens)
        return req.num_tokens

    def table(self, rid: str) -> list[int]:
        """The token-side block table reserved for `rid` (where its KV is streamed to)."""
        return self.tables[rid][1]

    def target(self, rid: str) -> TokenSide:
        return self.tables[rid][0]

    def send(self, seqs: Iterable[ScheduledSeq], parts: Iterable[Hashable]) -> list[KVStream]:
        """A prompt batch is dispatched: the KV each of its `seqs` streams into its reservation (what
        the token side's cached prefix lacks, spread over the prompt's chunks), and, from a request's
        first chunk on, that its KV arrives in `parts` (e.g. one per token stage; `kv_arrived`)."""
        parts = tuple(parts)
        cached, tables, pending, new = self.cached, self.tables, self.pending, tuple.__new__  # (see KVStream)
        streams = []
        for req, n, start, _, full, _ in seqs:  # (a ScheduledSeq's fields)
            rid, total = req.request_id, len(req.prompt_token_ids) + len(req.output_token_ids)
            have = cached.get(rid, 0)
            lo, hi = (have if full else max(start, have)), start + n
            if lo < hi:
                streams.append(new(KVStream, (rid, lo, hi, total, tables[rid][1], have)))
            if full and have < total:
                pending[rid] = set(parts)
        return streams

    def kv_arrived(self, rids: Iterable[str], part: Hashable) -> list[Request]:
        """One part of each of `rids`' KV is in place. Returns, in order, the requests parked waiting
        for the last of their parts (to `join`, or to `settle` if they finished meanwhile). An
        unexpected part (e.g. from before a failure) is ignored."""
        pending, parked, out = self.pending, self.parked, []
        for rid in rids:
            left = pending.get(rid)
            if left is None or part not in left:
                continue
            left.discard(part)
            if left:
                continue
            del pending[rid]
            req = parked.pop(rid, None)
            if req is not None:
                out.append(req)
        return out

    def sampled(self, reqs: Iterable[Request]) -> list[Request]:
        """`reqs`' first tokens were sampled on the prompt side (`Scheduler.take_handoffs`): returns
        those that may `join` the token side now, in order; the rest are parked until their KV has
        arrived."""
        pending, parked, out = self.pending, self.parked, []
        for req in reqs:
            if req.request_id in pending:
                parked[req.request_id] = req
            else:
                out.append(req)
        return out

    def join(self, req: Request) -> TokenSide:
        """Move unfinished `req` into its token pipeline's scheduler (its KV is in place there)."""
        tp, table = self.tables.pop(req.request_id)
        self.cached.pop(req.request_id, None)
        req.block_ids = table
        if tp.sched.config.policy == "microbatch":
            tp.ready.append(req)
            self.joined[req.request_id] = tp
        else:
            tp.sched.add_running(req)
        return tp

    def fill_microbatches(self, tp: TokenSide) -> None:
        """Microbatch policy: form token microbatches from the ready queue while a slot is free."""
        joined = self.joined
        while tp.ready and len(tp.sched.groups) < tp.depth:
            group = [tp.ready.popleft() for _ in range(min(tp.microbatch, len(tp.ready)))]
            for r in group:
                joined.pop(r.request_id, None)
            tp.sched.add_microbatch(group)

    # --- endings -------------------------------------------------------------------------------

    def settle(self, req: Request) -> TokenSide | None:
        """A finished request: give back its token-side reservation, or, while KV is still on its way
        into it, parked until `kv_arrived` returns it. Returns the pipeline whose blocks were freed, if any."""
        rid = req.request_id
        if rid in self.pending:
            self.parked[rid] = req
            return None
        self.parked.pop(rid, None)
        tp = self.joined.pop(rid, None)
        if tp is not None:  # joined, waiting for a microbatch: it holds its blocks itself
            tp.ready.remove(req)
            tp.kv_manager.release(req.block_ids)
            self.freed(tp)
            return tp
        entry = self.tables.pop(rid, None)
        self.cached.pop(rid, None)
        if entry is None or not entry[1]:
            return None
        entry[0].kv_manager.release(entry[1])
        self.freed(entry[0])
        return entry[0]

    def forget_kv(self, rid: str) -> None:
        """The KV on its way for `rid` is void (its prompt pipeline failed; it is recomputed)."""
        self.pending.pop(rid, None)

    @property
    def num_waiting(self) -> int:
        """Requests sampled but not yet running on the token side."""
        return len(self.parked) + sum(len(tp.ready) for tp in self.token)

    def drop_in_flight(self) -> list[Request]:
        """After a failure: forget every hand-off in progress; return the unfinished requests that
        were in it (to be recomputed) and give back every reservation of a request that is not
        running on the token side."""
        again = [r for r in list(self.parked.values()) + [r for tp in self.token for r in tp.ready] if not r.is_finished]
        self.parked.clear()
        self.pending.clear()
        self.joined.clear()
        for tp in self.token:
            for r in tp.ready:
                tp.kv_manager.release(r.block_ids)
            tp.ready.clear()
        running = {r.request_id for tp in self.token for r in tp.sched.running}
        for rid in [rid for rid in self.tables if rid not in running]:
            tp, table = self.tables.pop(rid)
            self.cached.pop(rid, None)
            if table:
                tp.kv_manager.release(table)
        self._target = (None, 0)
        self._freed.update(range(len(self.token)))
        return again
