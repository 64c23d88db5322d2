"""The discrete-event simulator: pipelines of machines serving a workload under a `SimConfig`.

Colocated pipelines (Baseline, Baseline-DP) run prompt and token passes of their microbatches in
one ring, with microbatch-level scheduling: when a microbatch's last request finishes (an early
stop), its slot is refilled by a new microbatch whose long prompt pass bubbles the ring.
Disaggregated layouts prefill on prompt pipelines, stream the KV layer by layer over the
network (overlapped with the prompt pass), and generate on token pipelines.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from kvflow.perf.perf_model import PerfModel
from kvflow.simulator.config import PipelineSpec, SimConfig
from kvflow.simulator.events import Arrival, Event, KVReady, PassDone, Recovered, WorkerFailure
from kvflow.simulator.metrics import SimResult
from kvflow.simulator.pipeline import Microbatch, Pipeline
from kvflow.simulator.workload import Workload


class Simulator:
    """One simulation run. `Simulator(config, perf, workload).run()` returns a `SimResult`."""

    def __init__(self, config: SimConfig, perf: PerfModel, workload: Workload) -> None:
        if workload.n == 0:
            raise ValueError("workload has no requests")
        self.config, self.perf, self.workload = config, perf, workload
        layout = config.layout
        self.arrival = workload.arrival.tolist()
        self.prompt_len = workload.prompt_len.tolist()
        self.out_len = workload.output_len.tolist()
        n = workload.n
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.completions = [0] * n
        self.restarts = 0
        self.prompt_queue: deque[int] = deque()
        self.token_queue: deque[int] = deque()
        self.prompt = self._group("prompt", layout.prompt, self.prompt_queue)
        self.token = self._group("token", layout.token, self.token_queue) if layout.token else []
        self.free_prompt: deque[Pipeline] = deque(self.prompt)
        self.free_token: deque[Pipeline] = deque(self.token)
        for p in self.prompt + self.token:
            p.listed = True
        self._mb_ids = itertools.count()
        self._times: dict[tuple, float] = {}
        # KV of one microbatch leaves over min(prompt depth, token depth) machine links at once.
        self.kv_links = min(layout.prompt.depth, layout.token.depth) if layout.token else 1

    def _group(self, role: str, spec: PipelineSpec, shared: deque) -> list[Pipeline]:
        own = self.config.dispatch == "round_robin" and role == "prompt"
        return [Pipeline(role, i, spec, deque() if own else shared) for i in range(spec.count)]

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        heap: list[tuple[float, int, Event]] = []
        seq = itertools.count()
        for ev in [Arrival(self.arrival[0], 0)] + [
                WorkerFailure(f.time, (self.token if f.role == "token" else self.prompt)[f.pipeline])
                for f in self.config.failures]:
            heapq.heappush(heap, (ev.time, next(seq), ev))
        while heap:
            _, _, ev = heapq.heappop(heap)
            for nxt in ev.handle(self):
                heapq.heappush(heap, (nxt.time, next(seq), nxt))
        return SimResult.build(self)

    # --- timing --------------------------------------------------------------------------------

    def _prompt_time(self, batch: int, prompt_len: int, depth: int) -> float:
        key = (0, batch, prompt_len, depth)
        if key not in self._times:
            self._times[key] = self.perf.prompt_stage_time(batch, prompt_len, depth)
        return self._times[key]

    def _token_time(self, batch: int, context: int, depth: int) -> float:
        key = (1, batch, context, depth)
        t = self._times.get(key)
        if t is None:
            t = self.perf.token_stage_time(batch, context, depth)
            if self.config.swapping:
                t = max(t, self.perf.swap_in_time(batch, context, depth))
            self._times[key] = t
        return t

    def _hop(self, batch: int, tokens: int) -> float:
        key = (2, batch, tokens)
        h = self._times.get(key)
        if h is None:
            h = self._times[key] = self.perf.hop_time(batch, tokens)
        return h

    def _start_pass(self, p: Pipeline, mb: Microbatch, now: float) -> PassDone:
        if mb.done == 0:
            b = len(mb.reqs)
            mb.pass_time = self._prompt_time(b, mb.prompt_len, p.depth)
            hop = self._hop(b, mb.prompt_len) if p.depth > 1 else 0.0
            start, finish = p.run_pass(now, mb.pass_time, hop)
            mb.ready = start
            return PassDone(finish, p, mb)
        b = len(mb.reqs) - mb.next_out
        key = (1, b, mb.prompt_len + mb.done, p.depth)
        t = self._times.get(key)
        if t is None:
            t = self._token_time(b, mb.prompt_len + mb.done, p.depth)
        mb.pass_time = t
        hop = self._hop(b, 1) if p.depth > 1 else 0.0
        mb.ready = now
        return PassDone(p.run_pass(now, t, hop)[1], p, mb)

    # --- dispatch ------------------------------------------------------------------------------

    def _admits(self, p: Pipeline) -> bool:
        if p.down or p.free_slots == 0:
            return False
        return p.admitting or not self.config.rigid_rounds

    def _fill(self, p: Pipeline, now: float) -> list[Event]:
        """Form microbatches from `p.queue` while `p` has free slots."""
        events = []
        q, token_role = p.queue, p.role == "token"
        while q and self._admits(p):
            reqs = [q.popleft() for _ in range(min(p.microbatch, len(q)))]
            plen = max(self.prompt_len[r] for r in reqs)
            mb = Microbatch(next(self._mb_ids), reqs, self.out_len, plen, 1 if token_role else 0)
            p.active[mb.id] = mb
            events.append(self._start_pass(p, mb, now))
        if self.config.rigid_rounds:
            p.admitting = False
        return events

    def _fill_free(self, free: deque[Pipeline], queue: deque[int], now: float) -> list[Event]:
        events = []
        while queue and free:
            p = free[0]
            events += self._fill(p, now)
            if not self._admits(p):
                free.popleft()
                p.listed = False
        return events

    def _slot_freed(self, p: Pipeline, now: float) -> list[Event]:
        if self.config.rigid_rounds and not p.active:
            p.admitting = True
        events = self._fill(p, now)
        if self._admits(p) and not p.listed and p.queue is (self.token_queue if p.role == "token"
                                                            else self.prompt_queue):
            (self.free_token if p.role == "token" else self.free_prompt).append(p)
            p.listed = True
        return events

    # --- handlers ------------------------------------------------------------------------------

    def on_arrival(self, now: float, first: int) -> list[Event]:
        i, n = first, len(self.arrival)
        rr = self.config.dispatch == "round_robin"
        touched = set()
        while i < n and self.arrival[i] <= now:
            if rr:
                p = self.prompt[i % len(self.prompt)]
                p.queue.append(i)
                touched.add(p.index)
            else:
                self.prompt_queue.append(i)
            i += 1
        events: list[Event] = [Arrival(self.arrival[i], i)] if i < n else []
        if rr:
            for k in sorted(touched):
                events += self._fill(self.prompt[k], now)
        else:
            events += self._fill_free(self.free_prompt, self.prompt_queue, now)
        return events

    def _emit(self, mb: Microbatch, now: float) -> None:
        """Record the token just produced for `mb` and finish the requests that are complete."""
        if mb.done == 1:
            for r in mb.live:
                if self.first_token[r] != self.first_token[r]:  # NaN: first time
                    self.first_token[r] = now
        reqs, out = mb.reqs, self.out_len
        while mb.next_out < len(reqs) and out[reqs[mb.next_out]] <= mb.done:
            r = reqs[mb.next_out]
            self.finish[r] = now
            self.completions[r] += 1
            mb.next_out += 1

    def on_pass_done(self, now: float, p: Pipeline, mb: Microbatch) -> list[Event]:
        p.busy += mb.pass_time
        was_prompt = mb.done == 0
        mb.done += 1
        self._emit(mb, now)
        events: list[Event] = []
        if was_prompt and self.token:  # disaggregated: stream KV to the token pipelines
            live = mb.live
            if live:
                nbytes = len(live) * mb.prompt_len * self.perf.kv_bytes_per_token
                start = max(mb.ready, p.link_free)
                p.link_free = start + self.perf.transfer_time(nbytes) / self.kv_links
                events.append(KVReady(max(now, p.link_free), live))
            del p.active[mb.id]
            return events + self._slot_freed(p, now)
        if mb.next_out == len(mb.reqs):
            del p.active[mb.id]
            return self._slot_freed(p, now)
        return [self._start_pass(p, mb, now)]

    def on_kv_ready(self, now: float, reqs: list[int]) -> list[Event]:
        self.token_queue.extend(reqs)
        return self._fill_free(self.free_token, self.token_queue, now)

    def on_failure(self, now: float, p: Pipeline) -> list[Event]:
        rec = self.config.recovery
        survivors = sorted(p.active.values(), key=lambda mb: mb.ready)
        requeue: list[int] = []
        restore_bytes = 0.0
        for mb in survivors:
            if mb.in_prompt or rec.mode == "restart":
                live = mb.live  # their first token, already seen by the user, keeps its time
                requeue += live
                self.restarts += len(live)
                del p.active[mb.id]
            else:
                ctx = mb.prompt_len + mb.done
                restore_bytes += len(mb.live) * ctx * self.perf.shape.layers_per_stage(p.depth) * \
                    self.perf.shape.kv_bytes_per_token_layer
        back = max(now, p.stage_free[0] if p.down else now) + rec.detect_s + rec.restart_s + \
            self.perf.transfer_time(restore_bytes)
        p.fail(now, back)
        # Restarted requests go back to the front of the queue that leads to a prompt pass.
        target = p.queue if p.role == "prompt" else self.prompt_queue
        target.extendleft(reversed(requeue))
        return [Recovered(back, p)] + self._fill_free(self.free_prompt, self.prompt_queue, now)

    def on_recovered(self, now: float, p: Pipeline) -> list[Event]:
        p.down = False
        if self.config.rigid_rounds and not p.active:
            p.admitting = True
        events: list[Event] = [self._start_pass(p, mb, now)
                               for mb in sorted(p.active.values(), key=lambda mb: mb.ready)]
        return events + self._slot_freed(p, now)


def simulate(config: SimConfig, perf: PerfModel, workload: Workload) -> SimResult:
    """Run one simulation (convenience wrapper)."""
    return Simulator(config, perf, workload).run()
