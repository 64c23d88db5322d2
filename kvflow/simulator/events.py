"""Simulator events. Each `handle(sim)` applies the event to the simulator state and returns the
events it causes (Vidur-style); the loop in `Simulator.run` only pops and pushes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.simulator.pipeline import Microbatch, Pipeline
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
    """Microbatch `mb` left the last stage of `pipeline` (void if the pipeline failed since)."""

    __slots__ = ("pipeline", "mb", "epoch")

    def __init__(self, time: float, pipeline: "Pipeline", mb: "Microbatch") -> None:
        self.time, self.pipeline, self.mb, self.epoch = time, pipeline, mb, pipeline.epoch

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.epoch != self.pipeline.epoch:
            return []
        return sim.on_pass_done(self.time, self.pipeline, self.mb)


class KVReady(Event):
    """Prompt KV of `reqs` has arrived in the token machines' host memory."""

    __slots__ = ("reqs",)

    def __init__(self, time: float, reqs: list[int]) -> None:
        self.time, self.reqs = time, reqs

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_kv_ready(self.time, self.reqs)


class WorkerFailure(Event):
    __slots__ = ("pipeline",)

    def __init__(self, time: float, pipeline: "Pipeline") -> None:
        self.time, self.pipeline = time, pipeline

    def handle(self, sim: "Simulator") -> list[Event]:
        return sim.on_failure(self.time, self.pipeline)


class Recovered(Event):
    """`pipeline` is repaired (void if it failed again meanwhile: that failure's repair counts)."""

    __slots__ = ("pipeline", "epoch")

    def __init__(self, time: float, pipeline: "Pipeline") -> None:
        self.time, self.pipeline, self.epoch = time, pipeline, pipeline.epoch

    def handle(self, sim: "Simulator") -> list[Event]:
        if self.epoch != self.pipeline.epoch:
            return []
        return sim.on_recovered(self.time, self.pipeline)
