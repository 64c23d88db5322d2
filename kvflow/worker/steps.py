"""What a worker keeps between steps besides its KV: a prepared step (`Prepared`), and the ids its
last stage sampled (`LastSampled`), which the first stage (the same process: decode-ahead pipelines
have one stage) feeds into a decode-ahead step in place of `AHEAD` (`SchedulerConfig.decode_ahead`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.model.batch import ForwardBatch
from kvflow.sched.output import AHEAD
from kvflow.streaming.swapper import SwapSeq
from kvflow.wire import Step


@dataclass
class Prepared:
    """A step ready to compute: its attention metadata, its requests' block tables, its swap list."""

    batch: ForwardBatch | None
    tables: dict[str, tuple[int, ...]]
    swap: list[SwapSeq]
    graphed: list[tuple[int, tuple[int, ...]]] | None = None  # (context, blocks) per row: a decode graph runs it


class LastSampled:
    """Request id -> (position, id) of the token this worker sampled (argmax) for it last."""

    def __init__(self) -> None:
        self.ids: dict[str, tuple[int, int]] = {}

    def record(self, msg: Step, rows: list[int], ids: list[int]) -> None:
        """The ids sampled for `msg`'s `rows` (each the token after its seq's context)."""
        seqs, last = msg.seqs, self.ids
        for rid in msg.free:  # (dropped before the step: a later step of the id starts it anew)
            last.pop(rid, None)
        for i, t in zip(rows, ids):
            last[seqs[i].rid] = (seqs[i].context_len, t)

    def fill(self, msg: Step) -> None:
        """Replace each `AHEAD` in `msg.token_ids` (a seq's last token) by the id sampled for its
        position; a decode-ahead step always follows the step that samples its input, in order."""
        at = 0
        for s in msg.seqs:
            at += s.num_new
            if msg.token_ids[at - 1] == AHEAD:
                pos, t = self.ids.get(s.rid, (-1, AHEAD))
                if pos != s.context_len - 1:
                    raise RuntimeError(f"decode-ahead step {msg.batch}: no token sampled for {s.rid} at {s.context_len - 1}")
                msg.token_ids[at - 1] = t

    def clear(self) -> None:
        self.ids.clear()
