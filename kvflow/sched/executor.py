"""The pipeline executor: how the scheduling core is driven for pipelines, written once.

The controller (worker processes, wire messages) and the simulator (an event clock, modelled step
times) both keep up to `depth` batches of each pipeline's `Scheduler` in flight, sample what a
returned batch completed, apply it, hand requests from the prompt side to the token side, route
token-side preemptions back to the prompt side and recover from a failed worker. Those decisions
live here; a driver only carries them out:

    executor.fill_all()            -> driver.dispatch(p, wire_id, out, free, streams)
    driver: batch `wire_id` came back  -> executor.complete(p, wire_id, result)
    driver: part of prompts' KV is in  -> executor.kv_arrived(rids, part)
    driver: a worker of `p` was lost   -> executor.recover(p, resume, voided)

A driver says how to sample (`sample`: real logits, or a fixed token in the simulator), how to
tell a request's owner about new tokens (`emit`), in which parts a prompt's KV arrives
(`kv_parts`: one per token stage, or one simulated link), and what to do once a finished request
holds nothing (`settled`). Everything else (queueing, offering, hand-off, recovery policy) is the
same code for both, so a policy written here is simulated as it runs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.kv.manager import KVCacheManager
from kvflow.sched.handoff import Handoff, KVStream  # noqa: F401  (KVStream re-exported)
from kvflow.sched.request import FINISHED, Request
from kvflow.sched.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

LOG_LEN = 100_000  # batches a pipeline's `batch_log` keeps


class PipelineState:
    """One pipeline as the executor sees it: its scheduler and block pool, the requests waiting for
    it (`queue`: shared by a group of prompt-side pipelines, or its own), its batches in flight
    (wire id -> scheduler output), the request ids whose tables its workers may forget with the next
    step, and (token role, microbatch policy) the requests whose KV is in place (`ready`). The
    controller's `Pipeline` and the simulator's `SimPipeline` add what their drivers need."""

    def __init__(self, role: str, depth: int, microbatch: int, sched: Scheduler, kv_manager: KVCacheManager,
                 queue: deque | None = None, log_batches: bool = True) -> None:
        self.role, self.depth, self.microbatch, self.sched = role, depth, microbatch, sched
        self.kv_manager = kv_manager
        self.queue: deque = queue if queue is not None else deque()
        self.in_flight: dict[int, SchedulerOutput] = {}
        self.pending_free: list[str] = []
        self.ready: deque = deque()
        self.down = False  # no batch is scheduled while a failed worker is being replaced
        # what each batch ran, [(request id, new tokens)], for tests and benchmarks (the latest LOG_LEN)
        self.batch_log: deque[list[tuple[str, int]]] | None = deque(maxlen=LOG_LEN) if log_batches else None

    @property
    def max_in_flight(self) -> int:
        """The most batches `fill` keeps in flight: `depth`, twice that when the pipeline decodes ahead
        (`SchedulerConfig.decode_ahead`: each batch's successor sent before it returns)."""
        return 2 * self.depth if self.sched.config.decode_ahead else self.depth


@dataclass(frozen=True)
class Voided:
    """What a recovery cost: the requests that lost their KV (recomputed from prompt + produced
    tokens), and the scheduled work of the voided batches of pipelines that kept their KV (redone)."""

    recompute: list[Request]
    redo: list[ScheduledSeq]


class Driver(Protocol):
    """What carries out the executor's decisions (see the module docstring)."""

    def dispatch(self, p: Any, wire_id: int, out: SchedulerOutput, free: list[str], streams: list[KVStream]) -> None:
        """Start batch `out` on `p`'s first stage; `free`: request ids whose tables the workers drop."""

    def sample(self, p: Any, out: SchedulerOutput, rows: list[int], result: Any) -> list[int]:
        """One token for each of `out.seqs[i]`, i in `rows`, from the batch's `result`."""

    def emit(self, req: Request) -> None:
        """`req` got a token or finished."""

    def kv_parts(self, p: Any) -> Iterable[Hashable]:
        """The parts in which the KV streamed by prompt pipeline `p` arrives (`kv_arrived`)."""

    def settled(self, req: Request) -> None:
        """Finished `req` holds no token-side reservation any more (its KV is not on its way)."""


class PipelineExecutor:
    """Drives the schedulers of one deployment: colocated pipelines (role "both") or prompt and token
    pipelines with the hand-off between them. `rigid_rounds`: a pipeline admits only when nothing
    of it runs (FasterTransformer's rounds). `make_request` turns a queue item that is not a
    `Request` (the simulator queues workload indices) into one when it is offered."""

    def __init__(self, prompt: Sequence[PipelineState], token: Sequence[PipelineState], driver: Driver,
                 rigid_rounds: bool = False, make_request: Callable[[Any], Request] | None = None) -> None:
        if not prompt:
            raise ValueError("an executor needs at least one pipeline that takes new requests")
        self.prompt, self.token, self.driver = list(prompt), list(token), driver
        self.pipelines = self.prompt + self.token
        self.handoff = Handoff(self.token) if self.token else None
        for p in self.prompt:
            if p.role == "prompt":  # admission reserves the blocks its KV will take on the token side
                p.sched.admit_hook = self.handoff.reserve
        self.queue = self.prompt[0].queue  # where token-side preemptions and recovered requests go
        self.rigid_rounds, self.make_request = rigid_rounds, make_request
        self.preemptions = 0
        self.version = 0  # bumped when a prompt-side queue grows or token-side blocks are freed
        self.dirty: set[PipelineState] = set()  # pipelines that may have something new to schedule
        self._wire_ids = itertools.count()  # unique across pipelines (each scheduler numbers its own)

    # --- requests in and out -------------------------------------------------------------------

    def submit(self, item: Any, p: PipelineState | None = None) -> None:
        """Queue a new request (or a driver's stand-in for one) for the prompt side (or `p`)."""
        self.submit_all((item,), p)

    def submit_all(self, items: Iterable[Any], p: PipelineState | None = None) -> None:
        """Queue new requests (or stand-ins) in order for the prompt side (or `p`), as `submit` of each."""
        (p or self.prompt[0]).queue.extend(items)
        self.version += 1

    def abort(self, req: Request) -> None:
        """The client went away: drop `req` wherever it is; blocks are freed now or when its batch
        or KV comes back."""
        for p in self.pipelines:
            if req in p.queue:
                p.queue.remove(req)
            if req in p.sched.waiting or req in p.sched.running:
                p.sched.abort(req)
                if p.role == "token":
                    self.handoff.freed(p)
        if not req.is_finished:  # queued, handed off, or waiting for a token microbatch
            req.finish("abort")
        self._settle(req)

    @property
    def num_waiting(self) -> int:
        """Requests queued, waiting in a scheduler, or between the prompt and the token side."""
        queued = sum(len(q) for q in {id(p.queue): p.queue for p in self.prompt}.values())
        return queued + sum(len(p.sched.waiting) for p in self.pipelines) + (self.handoff.num_waiting if self.handoff else 0)

    # --- filling pipelines (each call asks its Scheduler.schedule for a batch) ---------------

    def fill_all(self, todo: Iterable[PipelineState] | None = None) -> None:
        """Fill the free slots of `todo` (default: every pipeline), prompt-side pipelines first
        (their admission reserves token-side blocks)."""
        if todo is None:
            todo, self.dirty = self.pipelines, set()
        for p in sorted(todo, key=lambda p: p.role == "token"):
            self.fill(p)

    def fill(self, p: PipelineState) -> None:
        """While `p` has fewer than `max_in_flight` batches in flight: offer it queued requests,
        schedule, route preemptions, dispatch."""
        if p.down:
            return
        if p.ready:
            self.handoff.fill_microbatches(p)
        admitting = p.role != "token" and not (self.rigid_rounds and p.sched.running)
        while len(p.in_flight) < p.max_in_flight:
            offered = self._offer(p) if admitting else []
            out = p.sched.schedule()
            if offered:
                self._take_back(p, offered)
            self.preemptions += len(out.preempted)
            if p.role == "token" and out.preempted:
                for r in out.preempted:  # recomputed by the prompt side, first in line
                    self.queue.appendleft(r)
                self._blocks_freed(p)
            if out.is_empty and not out.tiers:  # (copies between KV tiers alone make a step: disk loads)
                p.pending_free += out.freed
                if out.preempted and p.role != "token":
                    continue  # the blocks it freed may admit a waiting request
                break
            self._dispatch(p, out)

    def _offer(self, p: PipelineState) -> list[Request]:
        """Move up to one batch's worth of queued requests into `p`'s scheduler. It only ever admits
        from the head of its waiting queue and at most `microbatch` per batch, so it decides exactly
        as if every queued request were in it (without holding a million of them)."""
        offered, queue, add = [], p.queue, p.sched.add
        for _ in range(min(p.microbatch, len(queue))):
            item = queue.popleft()
            req = item if isinstance(item, Request) else self.make_request(item)
            add(req)
            offered.append(req)
        return offered

    @staticmethod
    def _take_back(p: PipelineState, offered: list[Request]) -> None:
        """Return the offered requests `p` did not admit to the front of its queue, in order."""
        if not p.sched.waiting:
            return  # (it admitted them all)
        ids = {id(r) for r in offered}
        back = []
        while p.sched.waiting and id(p.sched.waiting[-1]) in ids:
            back.append(p.sched.waiting.pop())
        p.queue.extendleft(back)

    def _dispatch(self, p: PipelineState, out: SchedulerOutput) -> None:
        streams = self.handoff.send(out.seqs, self.driver.kv_parts(p)) if p.role == "prompt" else []
        free, p.pending_free = p.pending_free + out.freed, []
        wire_id = next(self._wire_ids)
        p.in_flight[wire_id] = out
        if p.batch_log is not None:
            p.batch_log.append([(s.request.request_id, s.num_new_tokens) for s in out.seqs])
        self.driver.dispatch(p, wire_id, out, free, streams)

    # --- results -------------------------------------------------------------------------------

    def complete(self, p: PipelineState, wire_id: int, result: Any) -> SchedulerOutput | None:
        """Batch `wire_id` of `p` left its last stage with `result`: sample a token for every request
        whose prompt it completed, apply the batch, and hand finished prompts to the token side.
        Returns the batch (None if it is not in flight: voided by a recovery)."""
        out = p.in_flight.pop(wire_id, None)
        if out is None:
            return None
        rows = out.sampling_rows()
        told = out.finished_before() if p.sched.config.decode_ahead else ()  # (told when they finished)
        sampled = {}
        if rows:
            toks = self.driver.sample(p, out, rows, result)
            seqs = out.seqs  # (a seq's request is its field 0: read by index, cheaper than by name)
            sampled = {seqs[i][0].request_id: t for i, t in zip(rows, toks)}
        emit, freed = self.driver.emit, False
        # (a request that joined a token pipeline holds nothing of the hand-off: its reservation became
        # its table, its KV is all in)
        settle = self.driver.settled if p.role == "token" else self._settle
        for req in p.sched.update(out, sampled):
            if id(req) not in told:
                emit(req)
            if req.status is FINISHED:
                freed = True
                settle(req)
        if freed and p.role != "prompt":
            self._blocks_freed(p)  # finished requests' blocks were freed
        if self.handoff is not None and p.sched.handoffs:
            self._to_token_side(self.handoff.sampled(p.sched.take_handoffs()))
        self.dirty.add(p)
        return out

    def kv_arrived(self, rids: Iterable[str], part: Hashable) -> None:
        """One part of the prompt KV of each of `rids` is in place on the token side (stale parts are ignored)."""
        self._to_token_side(self.handoff.kv_arrived(rids, part))

    def _to_token_side(self, reqs: list[Request]) -> None:
        dirty, join = self.dirty, self.handoff.join
        for req in reqs:
            if req.status is FINISHED:
                self._settle(req)
            else:
                dirty.add(join(req))

    def _blocks_freed(self, p: PipelineState) -> None:
        """Blocks of `p` (a token or colocated pipeline) were freed: what was refused may fit now."""
        self.version += 1
        if p.role == "token":
            self.handoff.freed(p)

    def _settle(self, req: Request) -> None:
        """A finished request: free its token-side reservation once no KV is still on its way."""
        if self.handoff is not None:
            tp = self.handoff.settle(req)
            if tp is not None:
                tp.pending_free.append(req.request_id)
                self.version += 1
            if req.request_id in self.handoff.pending:
                return  # settled again when the last part of its KV is in
        self.driver.settled(req)

    # --- failures ------------------------------------------------------------------------------

    def recover(self, lost: PipelineState, resume: dict[str, int] | None,
                voided: Sequence[PipelineState] | None = None,
                requeue_as: Callable[[Request], Any] | None = None) -> Voided:
        """A worker of `lost` failed and has been replaced; every batch in flight on the `voided`
        pipelines (default: all, as one controller's epoch fences them all) is void.

        `lost` resumes from its replica (`resume`: request -> tokens [0, n) whose KV was restored)
        or, without one, forgets its KV and recomputes its requests from prompt + produced tokens;
        prompt pipelines always recompute (their KV is streamed, never kept); every other voided
        pipeline keeps its KV and redoes its lost batches (`rewind` to its own progress). Requests
        to recompute go to the front of their queue in arrival order, as `requeue_as(req)` if
        given (a driver's fresh stand-in). Greedy and seeded outputs are those of a run without
        the failure."""
        every = voided is None or len(voided) == len(self.pipelines)
        voided = self.pipelines if voided is None else voided
        lost.kv_manager.reset_prefix_cache()  # the replacement's cache is empty: no cached prefix of it holds
        recompute: list[Request] = []  # lost their KV
        redo: list[ScheduledSeq] = []
        again: list[Request] = []  # to the shared prompt-side queue
        for p in voided:
            if (p is lost and resume is None) or p.role == "prompt":
                gone = p.sched.recompute_all()  # a prompt-side scheduler queues them in its waiting
                recompute += gone
                if p.role == "token":
                    again += gone
                else:
                    self._requeue(p.queue, list(p.sched.waiting), requeue_as)
                    p.sched.waiting.clear()
                if not every and self.handoff is not None:
                    for r in gone:
                        self.handoff.forget_kv(r.request_id)
            else:
                redo += [s for out in p.in_flight.values() for s in out.seqs]
                progress = resume if p is lost else {r.request_id: r.num_computed_tokens for r in p.sched.running}
                for r in p.sched.rewind(progress):
                    self._settle(r)
            p.in_flight.clear()
            p.pending_free.clear()
        if every and self.handoff is not None:
            again += self.handoff.drop_in_flight()  # hand-offs in progress: their KV may never arrive
        seen = {id(r) for r in self.queue if isinstance(r, Request)}
        again = sorted((r for r in again if id(r) not in seen), key=lambda r: r.arrival_time)
        self._requeue(self.queue, again, requeue_as)
        self.version += 1
        for p in [lost, *voided]:
            if p.role == "token":
                self.handoff.freed(p)
        self.dirty.update(voided)
        return Voided(recompute, redo)

    @staticmethod
    def _requeue(queue: deque, reqs: list[Request], requeue_as: Callable[[Request], Any] | None) -> None:
        queue.extendleft(reversed([requeue_as(r) for r in reqs] if requeue_as else reqs))

    def fail_all(self) -> list[Request]:
        """Forget every request (the deployment failed for good); returns those that were scheduled
        or queued (the driver fails them)."""
        reqs = [r for p in self.prompt for r in p.queue if isinstance(r, Request)]
        for p in self.pipelines:
            p.queue.clear()
            reqs += p.sched.fail_all()
            p.in_flight.clear()
        if self.handoff is not None:
            reqs += self.handoff.drop_in_flight()
        return reqs
