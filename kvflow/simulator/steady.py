"""A steady pipeline runs ahead: its microbatches' one-token steps played without events.

With the microbatch policy, a pipeline whose microbatches are all in flight, each a one-token step
of requests past their prompt, does nothing at a returning pass but send the same microbatch again
for its next token: the scheduler decides the same thing at every step (`Scheduler.steady_steps`),
and nothing outside the pipeline sees those steps (its requests' blocks were reserved at
admission, the simulated sampler's token stops no request before its length). That holds until
one of its passes finishes a request, or, while it has a free slot, until something joins it (a
token pipeline's hand-off, a request queued for a colocated one; while requests are queued for
it, a colocated pipeline with a free slot admits at its next return and is not steady).

`run_ahead` places those passes on the pipeline's stage clocks in the order their events would
have been handled, up to the first pass that will finish a request (or `CHUNK` passes), and gives
events only to the passes then in flight. The scheduler learns of the passes in between when
anything next reaches the pipeline (`settle`: at one of those events, or when the executor is
about to fill the pipeline with a free slot): the passes that returned before that moment are
applied at once (`Scheduler.run_ahead`), and the pipeline's clocks, busy time and batches in
flight are what step-by-step simulation would have made them. The batch log, the timeline and
every decision are those of simulating each pass as an event (tests/simulator/test_steady.py).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from kvflow.perf.perf_model import BatchShape
from kvflow.simulator.events import PIPELINE, PassDone
from kvflow.simulator.pipeline import Pass

if TYPE_CHECKING:
    from kvflow.simulator.pipeline import SimPipeline
    from kvflow.simulator.simulator import Simulator

CHUNK = 128  # passes run ahead at most before one is an event again (bounds what a join makes void)
_due = attrgetter("done_at", "order")  # which pass of a pipeline returns first


class _Slot:
    """One microbatch in flight while its pipeline runs ahead."""

    __slots__ = ("wire_id", "group", "left", "steps", "context", "stage_time", "done_at", "order", "entry")

    def __init__(self, wire_id: int, group: list, left: int, context: int, stage_time: float, done_at: float,
                 order: int) -> None:
        self.wire_id, self.group, self.left, self.steps = wire_id, group, left, 0
        self.context, self.stage_time, self.done_at, self.order = context, stage_time, done_at, order
        self.entry = (stage_time, done_at, order)  # the pass it had in flight when the run started


class Ahead:
    """A run ahead not yet applied: the pipeline's state when it started and each pass it played,
    as (returned at, slot, stage time of the returned pass, the slot's next pass as (stage time,
    done at, order), stage clocks after sending it)."""

    __slots__ = ("slots", "busy", "stage_free", "passes", "token")

    def __init__(self, slots: list[_Slot], busy: float, stage_free: list[float], token: int) -> None:
        self.slots, self.busy, self.stage_free, self.token = slots, busy, stage_free, token
        self.passes: list[tuple[float, int, float, tuple[float, float, int], list[float]]] = []


def run_ahead(sim: "Simulator", p: "SimPipeline", token: int) -> None:
    """Run `p` ahead while it is steady (see the module docstring), every step sampling `token`;
    nothing if it is not steady."""
    sched = p.sched
    n_groups = len(sched.groups)
    if p.down or not n_groups or len(p.in_flight) != n_groups:
        return
    if n_groups < p.depth and p.role != "token" and (p.queue or sched.waiting):
        return  # it admits at its next return
    slots = []
    for k, (wire_id, out) in enumerate(p.in_flight.items()):  # in the order they were sent
        group = next((g for g in sched.groups if len(g) == len(out.seqs)
                      and all(r is s.request for r, s in zip(g, out.seqs))), None)
        left = sched.steady_steps(group, token) if group is not None else None
        if left is None:
            return
        pas = p.passes[wire_id]
        slots.append(_Slot(wire_id, group, left, sum(s.end for s in out.seqs), pas.stage_time, pas.done_at,
                           k - len(p.in_flight)))
    ahead = Ahead(slots, p.busy, list(p.stage_free), token)
    per_stage = p.depth > 1 and not p.perf.uniform_stages
    times = sim._decode_times.setdefault((p.depth, p.role), {})
    sf, depth, record = p.stage_free, p.depth, ahead.passes.append
    order = 0
    index = {id(s): i for i, s in enumerate(slots)}
    while order < CHUNK:
        s = slots[0] if len(slots) == 1 else min(slots, key=_due)
        if s.steps == s.left:
            break  # its return finishes a request: an event
        returned, busy = s.done_at, s.stage_time  # it returns ...
        s.steps += 1
        n = len(s.group)  # ... and is sent again at once, one token further
        s.context += n
        priced = times.get((n, s.context))
        if priced is None:
            shape = BatchShape(decode_seqs=n, decode_context=s.context)
            t = sim._step_time(shape, p)
            priced = times[(n, s.context)] = (
                t, sim._hop(n, p) if depth > 1 else 0.0,
                [sim._stage_time(shape, p, k) for k in range(depth)] if per_stage else [t] * depth)
        s.stage_time, hop, stages = priced
        t = returned
        for k in range(depth):  # `SimPipeline.place`
            if k:
                t += hop
            t = sf[k] = (t if t > sf[k] else sf[k]) + stages[k]
        s.done_at, s.order = t, order
        record((returned, index[id(s)], busy, (s.stage_time, t, order), tuple(sf)))
        order += 1
    p.stage_free = ahead.stage_free  # (the clocks are replayed by `settle`)
    if not order:
        return
    for s in slots:  # the passes in flight at the stop get events; those they follow are void
        p.passes[s.wire_id] = pas = Pass(s.stage_time, s.done_at)
        sim._events.append(PassDone(s.done_at, p, s.wire_id, pas))
    p.ahead = ahead


def settle(sim: "Simulator", p: "SimPipeline", now: float, rank: int) -> None:
    """Apply the passes of `p`'s run ahead that returned before the event of (`now`, `rank`) is
    handled: `p` is then as step-by-step simulation leaves it at that point."""
    ahead, p.ahead = p.ahead, None
    mine = PIPELINE + p.number  # the rank of its passes' events
    past = 0
    for returned, *_ in ahead.passes:
        if returned > now or (returned == now and mine > rank):
            break
        past += 1
    sim.passes_run_ahead += past
    busy = ahead.busy
    slots = ahead.slots
    current = [s.entry for s in slots]  # each slot's pass in flight now: (stage time, done at, order)
    steps = [0] * len(slots)
    log = p.batch_log
    for _, i, spent, sent, _ in ahead.passes[:past]:
        busy += spent
        steps[i] += 1
        current[i] = sent
        if log is not None:
            log.append([(r.request_id, 1) for r in slots[i].group])
    p.busy = busy
    p.stage_free = list(ahead.passes[past - 1][4]) if past else ahead.stage_free
    sched = p.sched
    in_flight = {}
    for i in sorted(range(len(slots)), key=lambda i: current[i][2]):  # the scheduler's round robin: last sent, last
        s = slots[i]
        in_flight[s.wire_id] = sched.run_ahead(s.group, steps[i], ahead.token) if steps[i] else p.in_flight[s.wire_id]
        if steps[i] == s.steps:
            continue  # its pass now is the one the run stopped at: its event stands
        stage_time, done_at, _ = current[i]
        p.passes[s.wire_id] = pas = Pass(stage_time, done_at)
        sim._events.append(PassDone(done_at, p, s.wire_id, pas))
    p.in_flight.clear()
    p.in_flight.update(in_flight)
    if past:
        p.pending_free.clear()  # went with the first pass sent again
