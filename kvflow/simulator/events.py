"""Simulator events. Each `handle(sim)` applies the event to the simulator state and returns the
events it causes (Vidur-style); the loop in `Simulator.run` only pops and pushes.

Events at the same instant are handled by `rank` (failures, arrivals, then each pipeline's in
pipeline order, then arriving KV), and in the order they were caused within a rank: an order that
does not depend on when an event was pushed, so a pipeline that runs ahead (`steady`) keeps it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.simulator.pipeline import Pass, SimPipeline
    from kvflow.simulator.simulator import Simulator


FAILURE, ARRIVAL, PIPELINE = -1, 0, 1  # ranks; a pipeline's events rank PIPELINE + its number
KV = 1 << 30  # after every pipeline's


class Event:
    __slots__ = ("time", "rank")

    def handle(self, sim: "Simulator") -> list["Event"]:
        raise NotImplementedError


class Arrival(Event):
    """Requests `first` and every later one arriving at the same instant join the queue."""

    __slots__ = ("first",)

    def __init__(self, time: float, first: int) -> None:
        self.time, self.first, self.rank = time, first, ARRIVAL

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_arrival(self.time, self.first)


class PassDone(Event):
    """Batch `wire_id` (its clock data `pas`) left the last stage of `pipeline` (void if the
    pipeline failed since, or the batch was run ahead: then another `Pass` stands for it)."""

    __slots__ = ("pipeline", "wire_id", "pas")

    def __init__(self, time: float, pipeline: "SimPipeline", wire_id: int, pas: "Pass") -> None:
        self.time, self.pipeline, self.wire_id, self.pas = time, pipeline, wire_id, pas
        self.rank = PIPELINE + pipeline.number

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.pipeline.passes.get(self.wire_id) is not self.pas:
            return []
        return sim.on_pass_done(self.time, self.pipeline, self.wire_id)


class KVReady(Event):
    """The prompt KV of request `rid`, sent as `part`, is complete on the token side (void if it was
    re-planned since)."""

    __slots__ = ("rid", "part")

    def __init__(self, time: float, rid: str, part) -> None:
        self.time, self.rid, self.part, self.rank = time, rid, part, KV

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_kv_ready(self.time, self.rid, self.part)


class WorkerFailure(Event):
    __slots__ = ("pipeline",)

    def __init__(self, time: float, pipeline: "SimPipeline") -> None:
        self.time, self.pipeline, self.rank = time, pipeline, FAILURE

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_failure(self.time, self.pipeline)


class Recovered(Event):
    """`pipeline` is repaired (void if it failed again meanwhile: that failure's repair counts)."""

    __slots__ = ("pipeline", "epoch")

    def __init__(self, time: float, pipeline: "SimPipeline") -> None:
        self.time, self.pipeline, self.epoch = time, pipeline, pipeline.epoch
        self.rank = PIPELINE + pipeline.number

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.epoch != self.pipeline.epoch:
            return []
        return sim.on_recovered(self.time, self.pipeline)
