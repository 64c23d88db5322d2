"""What a worker keeps between steps besides its KV: a prepared step (`Prepared`), and the ids the
pipeline's last stage sampled (`LastSampled`), which its first stage feeds into a decode-ahead step in
place of `AHEAD` (`SchedulerConfig.decode_ahead`): its own in a pipeline of one stage, else sent to it
by the last stage (its `StepResult`s, with the positions).

A pipeline of one stage whose decode graphs decode ahead also keeps the step it launched last
(`Flight`): the next step may be launched behind it, its `AHEAD` rows fed on the device from the
flight's argmax (`LastSampled.sources`), before the flight's ids are read back and sent, as the
engine does; the worker's host work between steps then runs while the device computes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvflow.model.batch import ForwardBatch
from kvflow.model.cuda_graphs import Launch
from kvflow.sched.output import AHEAD
from kvflow.streaming.swapper import SwapSeq
from kvflow.wire import Step, StepResult


@dataclass
class Prepared:
    """A step ready to compute: its attention metadata, its requests' block tables, its swap list."""

    batch: ForwardBatch | None
    tables: dict[str, tuple[int, ...]]
    swap: list[SwapSeq]
    graphed: list[tuple[int, tuple[int, ...]]] | None = None  # (context, blocks) per row: a decode graph runs it


@dataclass
class Flight:
    """A decode step launched on the device whose ids are not read back yet: the step, its requests'
    block tables, the launch, each request's row, and when it started (its compute time runs to the
    read)."""

    msg: Step
    tables: dict[str, tuple[int, ...]]
    launch: Launch
    rows: dict[str, int]
    t0: float
    ticket: int = 0  # what `worker.compute.Landed` rings when its ids are on the host


class LastSampled:
    """Request id -> (position, id) of the token the pipeline's last stage sampled (argmax) for it last,
    and (a first stage of several) the steps held until the ids they take in are in."""

    HOLD_LIMIT_S = 120.0  # a held step whose ids have not come in this long: reported, not waited on forever

    def __init__(self) -> None:
        self.ids: dict[str, tuple[int, int]] = {}
        self.flight: Flight | None = None  # (one stage, decode graphs decoding ahead) the step on the device
        self.held: deque[tuple] = deque()  # (step, ...) in arrival order
        self.held_since = 0.0

    def admit(self, item: tuple) -> list[tuple]:
        """A step (`item[0]`, with what goes with it) in arrival order: the steps to run now (it, or
        none while it or one before it waits for ids)."""
        if not self.held and self.ready(item[0]):
            return [item]
        if not self.held:
            self.held_since = time.monotonic()
        self.held.append(item)
        return []

    def released(self) -> list[tuple]:
        """The held steps that can run now that more ids are in, in order."""
        out = []
        while self.held and self.ready(self.held[0][0]):
            out.append(self.held.popleft())
            self.held_since = time.monotonic()
        return out

    def overdue(self) -> bool:
        return bool(self.held) and time.monotonic() - self.held_since > self.HOLD_LIMIT_S

    def drop_held(self) -> int:
        n = len(self.held)
        self.held.clear()
        return n

    def record(self, msg: Step, rows: list[int], ids: list[int], known=None) -> None:
        """The ids sampled for `msg`'s `rows` (each the token after its seq's context); with `known`,
        only of those requests (a flight read back after a later step freed some)."""
        seqs, last = msg.seqs, self.ids
        for i, t in zip(rows, ids):
            if known is None or seqs[i].rid in known:
                last[seqs[i].rid] = (seqs[i].context_len, t)

    def forget(self, rids) -> None:
        """Requests freed (before a step: a later step of the id starts it anew)."""
        for rid in rids:
            self.ids.pop(rid, None)

    def take(self, res: StepResult, known) -> None:
        """The ids the last stage sampled (its result, sent on to this first stage with positions), of
        the requests in `known` (not yet freed: one freed meanwhile is not kept)."""
        last, rids = self.ids, res.rids
        for row, pos, t in zip(res.argmax_rows, res.positions, res.argmax_ids):
            if rids[row] in known:
                last[rids[row]] = (pos, t)

    @staticmethod
    def _aheads(msg: Step):
        """(index into `msg.token_ids`, seq) of each `AHEAD` (a seq's last token)."""
        at, ids = 0, msg.token_ids
        for s in msg.seqs:
            at += s.num_new
            if ids[at - 1] == AHEAD:
                yield at - 1, s

    def ready(self, msg: Step) -> bool:
        """Whether every `AHEAD` of `msg` can be filled: a first stage of several stages may have the
        step before the last stage's ids for it (they travel apart)."""
        return AHEAD not in msg.token_ids or all(
            self._launched(s) is not None or self._read_back(s) is not None for _, s in self._aheads(msg))

    def _read_back(self, s) -> int | None:
        """The id read back for `s`'s input position (an `AHEAD` seq's: the token before its context end), if any."""
        pos, t = self.ids.get(s.rid, (-1, None))
        return t if pos == s.context_len - 1 else None

    def _launched(self, s) -> int | None:
        """The row of the flight whose argmax `s` (an `AHEAD` seq) takes in, if it is in the flight."""
        f = self.flight
        row = f.rows.get(s.rid) if f is not None else None
        return row if row is not None and f.msg.seqs[row].context_len == s.context_len - 1 else None

    def sources(self, msg: Step) -> list[int] | None:
        """For a step of one token per request (a decode graph's): per row, the row of the flight whose
        argmax its `AHEAD` takes on the device, or -1 (its own token, or an `AHEAD` filled here from an
        id already read back); None if an `AHEAD` can be fed from neither."""
        out, ids = [], msg.token_ids
        for i, s in enumerate(msg.seqs):
            src = -1
            if ids[i] == AHEAD:
                row = self._launched(s)
                if row is not None:
                    src = row
                elif (t := self._read_back(s)) is not None:
                    ids[i] = t
                else:
                    return None
            out.append(src)
        return out

    def fill(self, msg: Step) -> None:
        """Replace each `AHEAD` in `msg.token_ids` by the id sampled for its position (a step is run
        only once it is `ready`)."""
        for i, s in self._aheads(msg):
            t = self._read_back(s)
            if t is None:
                raise RuntimeError(f"decode-ahead step {msg.batch}: no token sampled for {s.rid} at {s.context_len - 1}")
            msg.token_ids[i] = t

    def clear(self) -> None:
        self.flight = None
        self.ids.clear()
        self.held.clear()
