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
have been handled, up to the first pass that will finish a request (with a free slot too: a join
cuts the run short, and replaying its start and dropping its rest is cheap beside the events it
saves), and gives events only to the passes then in flight. The scheduler learns of the passes
in between when anything next reaches the pipeline (`settle`: at one of those events, or when the
executor is about to fill the pipeline with a free slot): the pipeline's clocks, busy time, round
robin and batches in flight are then what step-by-step simulation would have made them (replayed
from the start of the run when it is cut short). A microbatch's own requests are behind until its
own pass returns (`catch_up`): the passes it returned meanwhile, over any number of runs, are
applied then at once (`Scheduler.run_ahead`), as nothing reads them before (the executor's
`complete` reads only the batch that returned, `schedule` only microbatches not in flight, and the
next run ahead takes up a microbatch that is behind where the last one left it). The batch log,
the timeline and every decision are those of simulating each pass as an event
(tests/simulator/test_steady.py).
"""

from __future__ import annotations

from functools import reduce
from operator import add, itemgetter
from typing import TYPE_CHECKING

from kvflow.perf.perf_model import BatchShape
from kvflow.simulator.events import PIPELINE, PassDone
from kvflow.simulator.pipeline import Pass

if TYPE_CHECKING:
    from kvflow.simulator.pipeline import SimPipeline
    from kvflow.simulator.simulator import Simulator

UNBOUNDED = 1 << 62  # a run's length: up to the first pass that finishes a request


class _Run:
    """A pipeline's microbatches in flight while it runs ahead, in the order they return: stages
    are FIFO and a microbatch is sent again as it returns, so that order repeats (pass k returns
    microbatch k mod m). Per microbatch: its wire id, requests, passes it may still return without
    finishing one (`left`), passes returned (`steps`), context of its pass in flight, that pass's
    stage time, return time and position among the run's passes (-1: sent before the run)."""

    __slots__ = ("wire_ids", "groups", "left", "steps", "context", "stage_time", "done_at", "sent", "busy",
                 "stage_free", "played")

    def __init__(self, wire_ids, groups, left, context, stage_time, done_at, busy: float, stage_free: list[float]):
        self.wire_ids, self.groups, self.left, self.context = wire_ids, groups, left, context
        self.stage_time, self.done_at, self.busy, self.stage_free = stage_time, done_at, busy, stage_free
        self.steps, self.sent, self.played = [0] * len(groups), [-1] * len(groups), 0

    def copy(self) -> "_Run":
        return _Run(self.wire_ids, self.groups, self.left, list(self.context), list(self.stage_time),
                    list(self.done_at), self.busy, list(self.stage_free))


class Behind:
    """A microbatch's passes returned while running ahead and not yet applied to its requests
    (`steps`, each sampling `token`), and where the runs left it: passes it may still return
    without finishing a request, counting the one in flight (`left`), and that pass's context."""

    __slots__ = ("steps", "left", "context", "token")

    def __init__(self, steps: int, left: int, context: int, token: int) -> None:
        self.steps, self.left, self.context, self.token = steps, left, context, token


class Ahead:
    """A run ahead not yet applied: where the run stopped (`end`), when its last pass returned
    (`last`; passes return in order) and, if the run may be cut short (the pipeline has a free slot:
    something may join it), the pipeline when it started (`start`; else `end` itself) and when each
    pass returned; and the token every step sampled."""

    __slots__ = ("start", "end", "last", "returned", "token")

    def __init__(self, start: _Run, end: _Run, last: float, returned: list[float] | None, token: int) -> None:
        self.start, self.end, self.last, self.returned, self.token = start, end, last, returned, token


def run_ahead(sim: "Simulator", p: "SimPipeline", token: int) -> None:
    """Run `p` ahead while it is steady (see the module docstring), every step sampling `token`;
    nothing if it is not steady."""
    sched = p.sched
    n_groups = len(sched.groups)
    if p.down or not n_groups or len(p.in_flight) != n_groups:
        return
    if n_groups < p.depth and p.role != "token" and (p.queue or sched.waiting):
        return  # it admits at its next return
    for out in p.in_flight.values():  # (a prompt pass in flight: the cheap answer before any microbatch's)
        if not out.seqs or out.seqs[0].num_new_tokens != 1:
            return
    rows, lag = [], p.lag
    by_head = {id(g[0]): g for g in sched.groups if g}
    for wire_id, out in p.in_flight.items():  # each batch in flight is exactly one microbatch, and steady
        seqs = out.seqs
        group = by_head.get(id(seqs[0].request)) if seqs else None
        if group is None or len(group) != len(seqs):
            return
        behind = lag.get(wire_id)
        if behind is not None and behind.token != token:
            catch_up(p, wire_id)  # (its passes so far sampled another token)
            seqs, behind = p.in_flight[wire_id].seqs, None
        if behind is not None:  # (steady: where the last run left it)
            left, context = behind.left, behind.context
        else:
            context = 0
            for r, (req, n, start, _, _, _) in zip(group, seqs):
                if r is not req:
                    return
                context += start + n
            left = sched.steady_steps(group, token)
            if left is None:
                return
        pas = p.passes[wire_id]
        rows.append((pas.done_at, wire_id, group, left, context, pas.stage_time))
    rows.sort(key=itemgetter(0))  # the order they return in
    done_at, wire_ids, groups, left, context, stage_time = map(list, zip(*rows))
    start = _Run(wire_ids, groups, left, context, stage_time, done_at, p.busy, list(p.stage_free))
    # Only a pipeline with a free slot is settled before the passes in flight at the stop return
    # (cut short: its run is replayed from `start`); another's run is played on `start` itself.
    returned = [] if len(rows) < p.depth else None
    end = start.copy() if returned is not None else start
    last = _play(sim, p, end, UNBOUNDED, returned)
    if not end.played:
        return
    for i, wire_id in enumerate(end.wire_ids):  # the passes in flight at the stop get events; those they follow are void
        p.passes[wire_id] = pas = Pass(end.stage_time[i], end.done_at[i])
        sim._events.append(PassDone(end.done_at[i], p, wire_id, pas))
    p.ahead = Ahead(start, end, last, returned, token)


def _play(sim: "Simulator", p: "SimPipeline", run: _Run, limit: int, returned: list[float] | None) -> float | None:
    """Play up to `limit` passes of fresh `run` (stopping before a pass whose return finishes a
    request), as `Simulator.dispatch` would place them; `returned` collects when each returned.
    Returns when the last of them returned (None if none was played).

    How many passes that is follows from each microbatch's `left`, and each pass's price from its
    microbatch's context (one more token per request per pass), so both are known before the loop:
    what remains per pass is the tandem-queue recursion of `SimPipeline.place`, in the same
    floating-point operations in the same order."""
    assert not run.played, "a run is played from its start"
    m, depth = len(run.groups), p.depth
    steps, left, context, stage_time, done_at = run.steps, run.left, run.context, run.stage_time, run.done_at
    count = min([limit] + [i + (left[i] - steps[i]) * m for i in range(m)])  # pass k returns microbatch k % m
    if count <= 0:
        return None
    if returned is None and depth == 2 and m == 2 and p.perf.uniform_stages:
        return _play_two(sim, p, run, count)
    # Pass j is sent as pass j - m returns: `ret` holds when each pass returns (those in flight,
    # then each played one, appended as the loop goes: its iterator reaches them), `sts` each one's
    # stage time (counted busy as it returns).
    priced: list = [None] * count
    sts = stage_time + priced
    for i in range(min(m, count)):
        turns = len(range(i, count, m))
        n = len(run.groups[i])
        priced[i::m], sts[m + i::m] = _prices(sim, p, n, context[i], turns)
        context[i] += n * turns
        steps[i] += turns
    ret = done_at[:]
    busy, sf = reduce(add, sts[:count], run.busy), run.stage_free  # each pass's stage time, added in order
    put = ret.append
    if depth == 2:
        a, b = sf
        for t, (hop, s0, s1) in zip(ret, priced):
            a = (t if t > a else a) + s0
            t = a + hop
            b = (t if t > b else b) + s1
            put(b)
        sf[0], sf[1] = a, b
    else:
        for t, (hop, *stages) in zip(ret, priced):
            for k in range(depth):
                if k:
                    t += hop
                x = sf[k]
                t = sf[k] = (t if t > x else x) + stages[k]
            put(t)
    for i in range(min(m, count)):
        last = i + (len(range(i, count, m)) - 1) * m
        done_at[i], stage_time[i], run.sent[i] = ret[m + last], sts[m + last], last
    if returned is not None:
        returned += ret[:count]
    run.busy, run.played = busy, count
    return ret[count - 1]


def _play_two(sim: "Simulator", p: "SimPipeline", run: _Run, count: int) -> float:
    """`_play` of `count` passes of two microbatches on two stages that take the same time (most
    runs): the same recursion and the same sums in the same order, with each microbatch's stage
    times read in turn (every stage of a pass takes its stage time; its hop depends only on its
    size) instead of interleaved price tuples, only each microbatch's last return kept (`r0`,
    `r1`), and the stage time of each pass added to the busy time as it returns (`q0`, `q1`: those
    of the passes in flight)."""
    context, steps, done_at, stage_time, sf, groups = run.context, run.steps, run.done_at, run.stage_time, run.stage_free, run.groups
    n0, n1 = len(groups[0]), len(groups[1])
    turns0, turns1 = len(range(0, count, 2)), count // 2
    times0 = _prices(sim, p, n0, context[0], turns0)[1]
    times1 = _prices(sim, p, n1, context[1], turns1)[1] if turns1 else []
    h0, h1 = sim._hop(n0, p), sim._hop(n1, p)
    context[0] += n0 * turns0
    context[1] += n1 * turns1
    steps[0] += turns0
    steps[1] += turns1
    busy, (a, b), (r0, r1), (q0, q1) = run.busy, sf, done_at, stage_time
    for x0, x1 in zip(times0, times1):
        busy += q0
        a = (r0 if r0 > a else a) + x0
        t = a + h0
        b = (t if t > b else b) + x0
        busy += q1
        was, r0, q0 = r1, b, x0  # (`was`: when the pass that returns now returned)
        a = (r1 if r1 > a else a) + x1
        t = a + h1
        b = r1 = (t if t > b else b) + x1
        q1 = x1
    if turns0 > turns1:  # (an odd count: the first microbatch's last pass)
        x0 = times0[-1]
        busy += q0
        was = r0
        a = (r0 if r0 > a else a) + x0
        t = a + h0
        b = r0 = (t if t > b else b) + x0
        q0 = x0
    sf[0], sf[1] = a, b
    done_at[0], stage_time[0], run.sent[0] = r0, q0, (turns0 - 1) * 2
    if turns1:
        done_at[1], stage_time[1], run.sent[1] = r1, q1, 1 + (turns1 - 1) * 2
    run.busy, run.played = busy, count
    return was


def _prices(sim: "Simulator", p: "SimPipeline", n: int, context: int, turns: int) -> tuple[list, list]:
    """(hop, then each stage's time) and the stage time of `turns` one-token passes of a microbatch of
    `n` requests whose contexts sum to `context` before the first: `Simulator.dispatch`'s prices,
    kept per (pipeline depth, role, n) in two lists indexed by the context."""
    prices = sim._decode_times.get((p.depth, p.role, n))
    if prices is None:
        prices = sim._decode_times[(p.depth, p.role, n)] = ([], [])
    line, times = prices
    hi = context + turns * n
    if len(line) <= hi:
        more = [None] * (hi + 1 - len(line) + len(line) // 2)
        line += more
        times += more
    got = line[context + n:hi + 1:n]
    if not all(got):
        depth, per_stage = p.depth, p.depth > 1 and not p.perf.uniform_stages
        for j, x in enumerate(got):
            if x is None:
                c = context + (j + 1) * n
                shape = BatchShape(decode_seqs=n, decode_context=c)
                times[c] = step = sim._step_time(shape, p)
                got[j] = line[c] = (sim._hop(n, p) if depth > 1 else 0.0,
                                    *([sim._stage_time(shape, p, k) for k in range(depth)] if per_stage else (step,) * depth))
    return got, times[context + n:hi + 1:n]


def settle(sim: "Simulator", p: "SimPipeline", now: float, rank: int) -> None:
    """Apply the passes of `p`'s run ahead that returned before the event of (`now`, `rank`) is
    handled: `p` is then as step-by-step simulation leaves it at that point."""
    ahead, p.ahead = p.ahead, None
    mine = PIPELINE + p.number  # the rank of its passes' events
    end = ahead.end
    past = end.played
    if ahead.last > now or (ahead.last == now and mine > rank):
        assert ahead.returned is not None, "a pipeline without a free slot settled before its passes returned"
        past = 0
        for t in ahead.returned:
            if t > now or (t == now and mine > rank):
                break
            past += 1
    if past < end.played:  # cut short: replay up to the cut
        end = ahead.start.copy()
        _play(sim, p, end, past, None)
    sim.passes_run_ahead += past
    p.busy, p.stage_free = end.busy, end.stage_free
    log, m = p.batch_log, len(end.groups)
    if log is not None:
        for k in range(past):
            log.append([(r.request_id, 1) for r in end.groups[k % m]])
    in_flight, lag, sent = {}, p.lag, []
    for i in sorted(range(m), key=lambda i: end.sent[i]):  # the scheduler's round robin: last sent, last in line
        wire_id, steps = end.wire_ids[i], end.steps[i]
        if steps:
            sent.append(end.groups[i])
            behind = lag.get(wire_id)
            if behind is not None and behind.token != ahead.token:
                catch_up(p, wire_id)  # (its passes so far sampled another token)
            elif behind is not None:
                steps += behind.steps
            lag[wire_id] = Behind(steps, end.left[i] - end.steps[i], end.context[i], ahead.token)
        in_flight[wire_id] = p.in_flight[wire_id]
        if end.steps[i] == ahead.end.steps[i]:
            continue  # its pass now is the one the run stopped at: its event stands
        p.passes[wire_id] = pas = Pass(end.stage_time[i], end.done_at[i])
        sim._events.append(PassDone(end.done_at[i], p, wire_id, pas))
    p.sched.requeue(sent)
    p.in_flight.clear()
    p.in_flight.update(in_flight)
    if past:
        p.pending_free.clear()  # went with the first pass sent again


def catch_up(p: "SimPipeline", wire_id: int) -> None:
    """Apply to the scheduler the passes that `p`'s microbatch in flight as `wire_id` returned while
    running ahead (`Behind`): its requests and its batch in flight are then as step by step."""
    behind = p.lag.pop(wire_id, None)
    if behind is not None:
        out = p.in_flight[wire_id]
        p.in_flight[wire_id] = p.sched.run_ahead([s[0] for s in out.seqs], behind.steps, behind.token)  # (s.request)
