"""Simulator events. Each `handle(sim)` applies the event to the simulator state and returns the
events it causes (Vidur-style); the loop in `Simulator.run` only pops and pushes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.simulator.pipeline import SimPipeline
    from kvflow.simulator.simulator import Simulator


class Event:
    __slots__ = ("time",)

    def handle(self, sim: "Simulator") -> list["Event"]:
        raise NotImplementedError


class Arrival(Event):
    """Requests `first` and every later one arriving at the same instant join the queue."""

    __slots__ = ("first",)

    def __init__(self, time: float, first: int) -> None:
        self.time, self.first = time, first

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_arrival(self.time, self.first)


class PassDone(Event):
    """Batch `wire_id` left the last stage of `pipeline` (void if the pipeline failed since)."""

    __slots__ = ("pipeline", "wire_id", "epoch")

    def __init__(self, time: float, pipeline: "SimPipeline", wire_id: int) -> None:
        self.time, self.pipeline, self.wire_id, self.epoch = time, pipeline, wire_id, pipeline.epoch

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.epoch != self.pipeline.epoch:
            return []
        return sim.on_pass_done(self.time, self.pipeline, self.wire_id)


class KVReady(Event):
    """The prompt KV of request `rid`, sent as `part`, is complete on the token side (void if it was
    re-planned since)."""

    __slots__ = ("rid", "part")

    def __init__(self, time: float, rid: str, part) -> None:
        self.time, self.rid, self.part = time, rid, part

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_kv_ready(self.time, self.rid, self.part)


class WorkerFailure(Event):
    __slots__ = ("pipeline",)

    def __init__(self, time: float, pipeline: "SimPipeline") -> None:
        self.time, self.pipeline = time, pipeline

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_failure(self.time, self.pipeline)


class Recovered(Event):
    """`pipeline` is repaired (void if it failed again meanwhile: that failure's repair counts)."""

    __slots__ = ("pipeline", "epoch")

    def __init__(self, time: float, pipeline: "SimPipeline") -> None:
        self.time, self.pipeline, self.epoch = time, pipeline, pipeline.epoch

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.epoch != self.pipeline.epoch:
            return []
        return sim.on_recovered(self.time, self.pipeline)
