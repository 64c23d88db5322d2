"""The discrete-event simulator: the simulated driver of the pipeline executor.

Every pipeline runs the real scheduling core (`kvflow.sched.Scheduler`) over a `KVCacheManager`
block pool, and the decisions above it — batches in flight, sampling, the prompt-to-token hand-off,
preemption routing, recovery — are the controller's own, `kvflow.sched.executor.PipelineExecutor`.
This module only carries them out on a clock: a dispatched batch is placed on its pipeline's stages
with the performance model's `step_time` (a `PassDone` event when it leaves the last stage), a
prompt pipeline's stages stream each layer's KV over their own link as they compute it (a `KVReady`
event when it is in), every completed prompt "samples" a fixed token (lengths come from the
workload), and a failure takes pipelines down until their replacement is in (`Recovered`).
Colocated pipelines (Baseline, Baseline-DP) have role "both"; disaggregated layouts have prompt and
token pipelines.

At scale, most passes are a microbatch's one-token step that changes nothing but its own requests:
a pipeline in that state runs ahead in one go (`kvflow.simulator.steady`), and where no request can
hit another's cached prefix (generated prompts of their own, each admitted once) the pools count
blocks instead of naming them (`KVCacheManager(block_ids=False)`). Neither changes a decision.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
from collections import deque

from kvflow.kv.manager import KVCacheManager
from kvflow.perf.perf_model import BatchShape, PerfModel
from kvflow.sched.executor import KVStream, PipelineExecutor
from kvflow.sched.config import SwapLayout
from kvflow.sched.request import FINISHED, Request
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import Scheduler, SchedulerOutput
from kvflow.simulator.config import PipelineGroup, SimConfig
from kvflow.simulator.events import PIPELINE, Arrival, Event, KVReady, PassDone, Recovered, WorkerFailure
from kvflow.simulator.metrics import SimResult
from kvflow.simulator.pipeline import Pass, SimPipeline
from kvflow.simulator.steady import catch_up, run_ahead, settle
from kvflow.simulator.workload import Workload

UNLIMITED_CONTEXT = 1 << 40
SAMPLED = 0  # the token every simulated step "samples" (requests ignore EOS: lengths come from the workload)


class Simulator:
    """One simulation run. `Simulator(config, perf, workload).run()` returns a `SimResult`."""

    def __init__(self, config: SimConfig, perf: PerfModel, workload: Workload, log_batches: bool = False,
                 token_perf: PerfModel | None = None, steady: bool = True) -> None:
        """`log_batches`: keep every pipeline's `batch_log` (what each batch ran), as the controller does.
        `token_perf`: the token pipelines' performance model when it differs from the prompt side's
        (another tensor-parallel degree, DistServe-style placement); `perf` prices everything else.
        `steady=False`: every pass is an event (no pipeline runs ahead; the tests' reference)."""
        if workload.n == 0:
            raise ValueError("workload has no requests")
        if token_perf is not None and token_perf.shape != perf.shape:
            raise ValueError("prompt and token performance models must serve the same model")
        self.config, self.perf, self.workload = config, perf, workload
        self.token_perf = token_perf or perf
        self.log_batches = log_batches
        layout = config.layout
        self.arrival = workload.arrival.tolist()
        self.prompt_len = workload.prompt_len.tolist()
        self.out_len = workload.output_len.tolist()
        n = workload.n
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.kv_wait = [0.0] * n
        self.completions = [0] * n
        self.restarts = 0  # requests that lost their KV to a failure
        self.redone_prefills = 0  # prompt chunks in flight at a failure, redone (their KV was kept)
        self.max_model_len = config.max_model_len or UNLIMITED_CONTEXT
        # Generated prompts are each request's own; admitted once (microbatch policy, no failure), a
        # request can hit no cached prefix, not even its own: the pools need neither hashes nor ids.
        self.caching = config.prefix_caching and not (workload.prompts is None and config.policy == "microbatch"
                                                      and not config.failures)
        self.steady = steady and config.policy == "microbatch" and not (
            config.failures or config.swapping or config.shared_host or self.caching)
        self._params: dict[int, SamplingParams] = {}
        self._blank: dict[int, list[int]] = {}
        self.queue: deque = deque()  # prompt-side requests not yet offered: workload indices or Requests
        self.prompt = self._group(layout.prompt, "prompt" if layout.token else "both")
        self.token = self._group(layout.token, "token") if layout.token else []
        self.executor = PipelineExecutor(self.prompt, self.token, self, config.rigid_rounds, self._request)
        self.handoff = self.executor.handoff
        self.now = 0.0
        self._rank = 0  # of the event being handled
        self._events: list[Event] = []  # what dispatching batches caused, collected by `_fill_all`
        self._times: dict[tuple, float] = {}
        self.passes_run_ahead = 0  # passes no event stood for (`steady`)
        self._decode_times: dict[tuple, tuple] = {}  # (depth, role, seqs) -> by context: `steady`'s prices
        self._idle: set[SimPipeline] = set(self.prompt)  # prompt-side pipelines with a free slot
        self._tried: dict[SimPipeline, int] = {}
        self._quiet: int | None = None  # a version at which every idle pipeline has tried (none to look at)
        for k, p in enumerate(self.prompt + self.token):
            p.number = k

    def _group(self, spec: PipelineGroup, role: str) -> list[SimPipeline]:
        own = self.config.dispatch == "round_robin"
        perf = self.token_perf if role == "token" else self.perf
        out = []
        for i in range(spec.count):
            blocks = self._pool_blocks(spec, role, perf)
            kv = KVCacheManager(blocks, self.config.block_size, self.caching, block_ids=self.caching)
            sched = Scheduler(self.config.scheduler_for(spec, role, blocks), kv, self.max_model_len, role)
            out.append(SimPipeline(role, i, spec, kv, sched, deque() if own else self.queue, perf, self.log_batches))
        return out

    def _pool_blocks(self, spec: PipelineGroup, role: str, perf: PerfModel) -> int:
        """The pool: from the configured device blocks, or what the most loaded stage's memory holds (`kv_capacity_tokens`)."""
        if self.config.kv_blocks is not None:
            if self.config.swapping and role != "prompt":
                return SwapLayout.of_device(self.config.kv_blocks, spec.depth).pool_blocks
            return self.config.kv_blocks
        resident = min(2, spec.depth) if self.config.swapping and role != "prompt" else None
        tokens = perf.kv_capacity_tokens(spec.depth, resident)
        if tokens < self.config.block_size:
            raise ValueError(f"a {spec.depth}-stage pipeline of {perf.shape.name} on {perf.machine.name} "
                             f"has no memory left for KV")
        return tokens // self.config.block_size

    def _request(self, i: int) -> Request:
        params = self._params.get(self.out_len[i])
        if params is None:
            params = self._params[self.out_len[i]] = SamplingParams(max_tokens=self.out_len[i], temperature=0.0,
                                                                    ignore_eos=True)
        if self.workload.prompts is not None:
            prompt = list(self.workload.prompts[i])
        elif self.caching:
            prompt = [i] * self.prompt_len[i]  # a prompt of its own
        else:  # nothing reads what an uncached prompt holds: one list per length, copied by the request
            prompt = self._blank.get(self.prompt_len[i]) or self._blank.setdefault(self.prompt_len[i], [0] * self.prompt_len[i])
        return Request(str(i), prompt, params, arrival_time=self.arrival[i])

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        heap: list[tuple[float, int, int, Event]] = []
        seq = itertools.count()
        for ev in [Arrival(self.arrival[0], 0)] + [
                WorkerFailure(f.time, (self.token if f.role == "token" else self.prompt)[f.pipeline])
                for f in self.config.failures]:
            heapq.heappush(heap, (ev.time, ev.rank, next(seq), ev))
        gc_was = gc.isenabled()
        gc.disable()  # millions of short-lived objects and no cycles: collections would find nothing
        try:
            self._loop(heap, seq)
        finally:
            if gc_was:
                gc.enable()
        return SimResult.build(self)

    def _loop(self, heap: list, seq) -> None:
        while heap:
            now, rank, _, ev = heapq.heappop(heap)
            self.now, self._rank = now, rank
            for nxt in ev.handle(self) + self._fill_all():
                heapq.heappush(heap, (nxt.time, nxt.rank, next(seq), nxt))
        return SimResult.build(self)

    def _fill_all(self) -> list[Event]:
        """Let every pipeline that may have something to do fill its free slots (the executor's
        `fill_all`, skipping idle pipelines whose queue has not changed since they last tried).
        Idle prompt pipelines are offered the queue in order only until the token side refuses an
        admission (`Handoff.refusals`): it then refuses the head of the queue to every prompt
        pipeline until it frees blocks (a refused request keeps the token pipeline it was given),
        and a microbatch prompt pipeline has nothing else to run, so no other prompt pipeline is
        filled in this call; the idle ones stay as they are, untried."""
        ex = self.executor
        version = ex.version
        walk = (self.queue or self.config.dispatch == "round_robin") and version != self._quiet
        if not (ex.dirty or walk):  # nothing to fill (after a void event, most often)
            self._quiet = version
            events, self._events = self._events, []
            return events
        todo, ex.dirty = ex.dirty, set()
        refusing = self.config.policy == "microbatch"  # a refusal ends every prompt pipeline's turn
        lazy = refusing and self.prompt[0].role == "prompt"  # idle ones tried in order until one is refused
        if walk and not lazy:
            for p in self._idle:
                if p.queue and self._tried.get(p) != version and p not in todo:
                    todo.add(p)
        for p in todo:
            self._tried[p] = version
            if p.ahead is not None and len(p.sched.groups) < p.depth:  # with a free slot, filling it may change its run
                settle(self, p, self.now, self._rank)
        handoff = self.handoff
        refusals = handoff.refusals if handoff is not None else 0
        idle = self._idle_in_order(todo, version) if walk and lazy else iter(())
        q = next(idle, None)  # the idle ones go in between, in the executor's `fill_all` order
        for p in sorted(todo, key=_fill_order) + [None]:
            while q is not None and (p is None or _fill_order(q) < _fill_order(p)):
                self._tried[q] = version
                ex.fill(q)
                if len(q.in_flight) == q.depth or q.down:
                    self._idle.discard(q)
                refused = handoff is not None and handoff.refusals != refusals
                q = None if refused else next(idle, None)  # (the rest stay idle, untried: as if refused)
            if p is not None and not (p.role == "prompt" and refusing and handoff.refusals != refusals):
                ex.fill(p)
        for p in todo:
            if self.steady and p.role != "prompt" and p.ahead is None:
                run_ahead(self, p, SAMPLED)
            if p.role != "token":
                if len(p.in_flight) < p.depth and not p.down:
                    self._idle.add(p)
                else:
                    self._idle.discard(p)
        # (a queue grows, and blocks are freed, only with a new version)
        self._quiet = version if ex.version == version else None
        events, self._events = self._events, []
        return events

    def _idle_in_order(self, todo: set[SimPipeline], version: int):
        """Idle prompt pipelines (not in `todo`) with requests queued for them that have not tried
        at `version`, in pipeline order, found as they are asked for."""
        idle, tried = self._idle, self._tried
        for q in self.prompt:
            if q in idle and q.queue and tried.get(q) != version and q not in todo:
                yield q

    # --- the driver ----------------------------------------------------------------------------

    def dispatch(self, p: SimPipeline, wire_id: int, out: SchedulerOutput, free: list[str], streams: list[KVStream]) -> None:
        """Place the batch on `p`'s stages: one `step_time` per stage, activation hops between them;
        a prompt pipeline's stages also stream the KV they compute."""
        seqs = [(n, start + n) for _, n, start, _, _, _ in out.seqs]  # (num_new_tokens, end)
        shape = BatchShape.of(seqs)
        t = self._step_time(shape, p)
        hop = self._hop(shape.tokens, p) if p.depth > 1 else 0.0
        spans = p.place(self.ready_at(p, wire_id, out), t, hop, self._durations(shape, p, t))
        pas = p.passes[wire_id] = Pass(t, spans[-1][1])
        if streams:  # what the token side's cached prefix lacks
            tokens = sum(k.end - k.start for k in streams)
            pas.kv_done = p.stream(spans, [p.perf.kv_transfer_time(tokens, p.depth, k) for k in range(p.depth)])
        elif p.role == "prompt":
            pas.kv_done = spans[-1][1]
        self._events.append(PassDone(spans[-1][1], p, wire_id, pas))

    def ready_at(self, p: SimPipeline, wire_id: int, out: SchedulerOutput) -> float:
        """When batch `wire_id` can start on stage 0 (if free): now, or decoding ahead in a deeper
        pipeline, once the passes in flight that sample its requests' input ids have left the last
        stage and the ids made the hop back (in a pipeline of one stage they come first, FIFO)."""
        start = self.now
        if p.depth > 1 and p.sched.config.decode_ahead and len(p.in_flight) > 1:
            mine = {id(s[0]) for s in out.seqs}
            for w, o in p.in_flight.items():
                if w != wire_id and w in p.passes and any(id(s[0]) in mine for s in o.seqs):
                    start = max(start, p.passes[w].done_at + self._hop(len(o.seqs), p))
        return start

    def sample(self, p: SimPipeline, out: SchedulerOutput, rows: list[int], result) -> list[int]:
        return [SAMPLED] * len(rows)

    def emit(self, req: Request) -> None:
        i = int(req.request_id)
        if self.first_token[i] != self.first_token[i]:  # NaN: its first token
            self.first_token[i] = self.now
        if req.status is FINISHED:
            self.finish[i] = self.now
            self.completions[i] += 1

    def kv_parts(self, p: SimPipeline) -> tuple:
        return ((p, p.epoch),)  # one simulated link per pipeline; a failure voids what was on it

    def settled(self, req: Request) -> None:
        pass

    def _step_time(self, shape: BatchShape, p: SimPipeline) -> float:
        key = (shape, p.depth, p.role)
        t = self._times.get(key)
        if t is None:
            t = p.perf.step_time(shape, p.depth)
            if self.config.swapping and p.role != "prompt" and shape.decode_seqs and not shape.prefill_seqs:
                ctx = -(-shape.decode_context // shape.decode_seqs)
                t = max(t, p.perf.swap_in_time(shape.decode_seqs, ctx, p.depth))
            self._times[key] = t
        return t

    def _durations(self, shape: BatchShape, p: SimPipeline, t: float):
        """Each stage's time for the pass (`place`'s `duration`), or None when every stage takes `t`:
        stages of unequal shares price their own (`stage_step_time`; with swapping, the slowest
        stage's `t` covers the swap-in); on a shared host a stage that starts while another stage
        of the host is busy runs slower by `co_run_factor` for as long as they overlap."""
        per_stage = p.depth > 1 and not self.config.swapping and not p.perf.uniform_stages
        factor = p.perf.co_run_factor(shape) if self.config.shared_host else 1.0
        if not per_stage and factor <= 1.0:
            return None  # (the planner's case: every stage takes `t`)
        stages = [self._stage_time(shape, p, k) for k in range(p.depth)] if per_stage else [t] * p.depth

        def duration(k: int, start: float) -> float:
            tk = stages[k]
            if factor <= 1.0:
                return tk
            busy = max((end for q in self.prompt + self.token for j, end in enumerate(q.stage_free)
                        if not (q is p and j == k)), default=0.0) - start
            if busy <= 0.0:
                return tk
            return tk * factor if busy >= tk * factor else busy + (tk - busy / factor)
        return duration

    def _stage_time(self, shape: BatchShape, p: SimPipeline, stage: int) -> float:
        key = (shape, p.depth, p.role, stage)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = p.perf.stage_step_time(shape, p.depth, stage)
        return t

    def _hop(self, tokens: int, p: SimPipeline) -> float:
        key = ("hop", tokens, p.role)
        h = self._times.get(key)
        if h is None:
            h = self._times[key] = p.perf.hop_time(1, tokens)
        return h

    # --- handlers ------------------------------------------------------------------------------

    def on_arrival(self, now: float, first: int) -> list[Event]:
        n = len(self.arrival)
        i = bisect.bisect_right(self.arrival, now, first)  # (arrivals are sorted) every one up to `now`
        if self.config.dispatch == "round_robin":
            for k in range(first, i):
                self.executor.submit(k, self.prompt[k % len(self.prompt)])
        else:
            self.executor.submit_all(range(first, i))
        return [Arrival(self.arrival[i], i)] if i < n else []

    def on_pass_done(self, now: float, p: SimPipeline, wire_id: int) -> list[Event]:
        if p.ahead is not None:
            settle(self, p, now, PIPELINE + p.number)
        if p.lag:
            catch_up(p, wire_id)
        pas = p.passes.pop(wire_id)
        p.busy += pas.stage_time
        out = self.executor.complete(p, wire_id, None)
        events: list[Event] = []
        if p.role == "prompt":  # handed off, or finished at its first token: both wait for their KV
            part, parked, done = (p, p.epoch), self.handoff.parked, pas.kv_done
            rids = [rid for s in out.seqs if (rid := s[0].request_id) in parked]  # (s.request)
            if done > now:
                for rid in rids:
                    self.kv_wait[int(rid)] = done - now
                    events.append(KVReady(done, rid, part))
            elif rids:
                for rid in rids:
                    self.kv_wait[int(rid)] = 0.0
                self.executor.kv_arrived(rids, part)
        return events

    def on_kv_ready(self, now: float, rid: str, part) -> list[Event]:
        self.executor.kv_arrived((rid,), part)  # nothing if re-planned since (its prompt pipeline failed)
        return []

    def on_failure(self, now: float, p: SimPipeline) -> list[Event]:
        """The executor's recovery: `p` (and with `fence='all'` every pipeline) loses its batches in
        flight; restart mode, and any prompt pipeline (prompt KV is not replicated), recompute the
        lost requests; resume mode restores the lost stage's KV from its replica (which costs
        `restore_s`, or the KV's transfer time) and redoes only the lost batches. The pipelines are
        down until detection, the replacement and the restore are over."""
        rec = self.config.recovery
        restore, resume = 0.0, None
        if rec.mode == "resume" and p.role != "prompt":
            resume = {r.request_id: r.num_computed_tokens for r in p.sched.running if not r.is_finished}
            restore = rec.restore_s if rec.restore_s is not None else p.perf.kv_transfer_time(sum(resume.values()), p.depth)
        voided = self.prompt + self.token if rec.fence == "all" else [p]
        fresh = (lambda r: int(r.request_id)) if rec.mode == "restart" and rec.from_scratch else None
        cost = self.executor.recover(p, resume, voided, fresh)
        self.restarts += len(cost.recompute)
        self.redone_prefills += sum(1 for s in cost.redo if s.num_new_tokens > 1)
        back = max(now, p.stage_free[0] if p.down else now) + rec.detect_s + rec.down_s + restore
        for q in voided:
            q.fail(back)
            self._idle.discard(q)
        return [Recovered(back, q) for q in voided]

    def on_recovered(self, now: float, p: SimPipeline) -> list[Event]:
        p.down = False
        self.executor.dirty.add(p)
        return []


def _fill_order(p: SimPipeline) -> tuple[bool, int]:
    """The executor's `fill_all` order: prompt-side pipelines first (their admission reserves
    token-side blocks), each side in pipeline order."""
    return p.role == "token", p.index


def simulate(config: SimConfig, perf: PerfModel, workload: Workload, token_perf: PerfModel | None = None) -> SimResult:
    """Run one simulation (convenience wrapper); `token_perf` as in `Simulator`."""
    return Simulator(config, perf, workload, token_perf=token_perf).run()
