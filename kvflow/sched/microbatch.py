"""The microbatch policy of the scheduling core (DéjàVu's): a pipeline keeps up to `max_in_flight`
fixed microbatches, sends them round robin, each with all its pending tokens, and admits a new one
only while a slot is free, reserving every token a request may produce up front (so it is never
preempted). A token pipeline forms its microbatches from requests whose KV is in place
(`add_microbatch`). For a simulator, the steps a steady microbatch takes without deciding anything
new (`steady_steps`) can be applied at once (`run_ahead`, `requeue`).

`MicrobatchPolicy` is part of `kvflow.sched.scheduler.Scheduler` (its base class, kept apart to keep
each file short): it reads and changes the scheduler's state as the scheduler's own methods do.
"""

from __future__ import annotations

import itertools
from operator import attrgetter
from typing import TYPE_CHECKING

from kvflow.kv.manager import NO_HIT, blocks_for
from kvflow.sched.output import ScheduledSeq, SchedulerOutput
from kvflow.sched.request import FINISHED, Request

if TYPE_CHECKING:
    from kvflow.sched.scheduler import Scheduler

_request_id = attrgetter("request_id")


class MicrobatchPolicy:
    """The microbatch policy's methods of `Scheduler` (see the module docstring)."""

    def _schedule_microbatch(self: Scheduler) -> list[ScheduledSeq]:
        """The next microbatch whose previous pass has returned, or a new one if a slot is free."""
        in_flight = self.in_flight
        for group in self.groups:  # round robin: a group that just ran goes to the back
            if in_flight.isdisjoint(map(_request_id, group)):
                self.groups.remove(group)
                self.groups.append(group)
                return self._whole(group)
        if len(self.groups) >= self.config.max_in_flight or self.role == "token":
            return []
        group: list[Request] = []
        config, kv, waiting, loading, hook = self.config, self.kv_manager, self.waiting, self._loading, self.admit_hook
        caching = kv.prefix_caching  # (without it, `_match` is NO_HIT)
        room = config.swap_region_blocks if config.swap_regions else None  # device blocks of a region
        while waiting and len(group) < config.microbatch_size:
            req = waiting[0]
            if req.request_id in loading:
                break
            total = len(req.prompt_token_ids) + req.params.max_tokens  # reserved up front: never preempted
            hit = self._match(req) if caching else NO_HIT
            if not kv.can_ensure(req.block_ids, total, hit):
                break
            if room is not None:
                if blocks_for(total, kv.block_size) > room:
                    break
                room -= blocks_for(total, kv.block_size)
            if hook is not None and not hook(req):
                break
            waiting.popleft()
            self._admit(req, total, hit)
            group.append(req)
        if not group:
            return []
        self.groups.append(group)
        return self._whole(group)

    def _whole(self: Scheduler, group: list[Request]) -> list[ScheduledSeq]:
        """Each request of microbatch `group` with all its pending tokens (its whole table when the
        executor's copy must be replaced)."""
        full_table, new = self._full_table, tuple.__new__  # (a named tuple's own constructor is Python code)
        if not full_table:  # (most batches: a microbatch sent again)
            return [new(ScheduledSeq, (r, len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens,
                                       r.num_computed_tokens, (), False, ())) for r in group]
        out, frozen = [], self.kv_manager.frozen
        for r in group:
            c = r.num_computed_tokens
            n = len(r.prompt_token_ids) + len(r.output_token_ids) - c
            if r.request_id in full_table:
                full_table.discard(r.request_id)
                out.append(new(ScheduledSeq, (r, n, c, frozen(r.block_ids), True, ())))
            else:
                out.append(new(ScheduledSeq, (r, n, c, (), False, ())))
        return out

    def steady_steps(self: Scheduler, group: list[Request], token: int) -> int | None:
        """Microbatch policy: how many one-token passes of `group` (the microbatch now in flight
        counted as the first) return before one that finishes a request, if each samples `token`;
        None when a pass of it may do anything else (a prompt chunk, a stop check on text)."""
        steps, limit = None, self.max_model_len
        for r in group:
            if len(r.prompt_token_ids) + len((out := r.output_token_ids)) - r.num_computed_tokens != 1 or not out \
                    or r.status is FINISHED:
                return None
            left = r.steps_to_length(token, limit)
            if left is None:
                return None
            if steps is None or left < steps:
                steps = left
        return None if steps is None else steps - 1

    def run_ahead(self: Scheduler, group: list[Request], steps: int, token: int) -> SchedulerOutput:
        """Microbatch policy: apply `steps` returned passes of microbatch `group` at once (each a
        one-token step of all of it sampling `token`, none finishing one: at most `steady_steps`)
        with the `schedule()` that re-sent it after each. Returns the batch now in flight for it,
        as the last of those calls formed it (batch ids are consumed as by `steps` calls). The
        round robin is the caller's (`requeue`): it may apply passes after others were sent."""
        assert self.config.policy == "microbatch" and steps > 0
        more = [token] * steps
        cache = self.kv_manager.cache_blocks if self.kv_manager.prefix_caching else None
        for r in group:
            start = r.num_computed_tokens
            r.extend_tokens(more)
            r.num_computed_tokens = start + steps
            if cache is not None:
                cache(r.block_ids, r.token_ids, r.block_hashes, start, start + steps)
        batch_id = next(self._ids) + steps - 1
        self._ids = itertools.count(batch_id + 1)
        return SchedulerOutput(batch_id, self._whole(group))

    def requeue(self: Scheduler, groups: list[list[Request]]) -> None:
        """Microbatch policy: `groups` were re-sent in this order; each goes to the round robin's back."""
        for g in groups:
            self.groups.remove(g)
            self.groups.append(g)

    def add_microbatch(self: Scheduler, requests: list[Request]) -> None:
        """Token role with the microbatch policy: requests whose KV is in place run as one microbatch."""
        for r in requests:
            self.add_running(r)
        self.groups.append(list(requests))
