"""What one `Scheduler.schedule()` decides: the requests of a batch, how many tokens each computes
and into which blocks (`ScheduledSeq`), and the batch around them (`SchedulerOutput`): what every
executor (engine, workers, simulator) carries out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvflow.kv.tiers import TierPlan
from kvflow.sched.request import FINISHED, Request

# A step's input token that its executor does not know yet: the one the worker itself sampled for
# the request in its previous step (a decode-ahead seq, `SchedulerConfig.decode_ahead`).
AHEAD = -1


class ScheduledSeq(NamedTuple):
    """`num_new_tokens` tokens of `request`, starting at `start` (its computed count when scheduled).
    `new_block_ids`: blocks this batch added to its table; `full_table`: they are the whole table, which
    replaces an executor's copy of it (first batch since admission, a preemption or a rewind).
    A decode-ahead seq (`ahead`) starts at the request's token count: its one token is sampled by the
    batch in flight before it.
    (A named tuple: one is made per request per batch, and a simulated run makes millions.)"""

    request: Request
    num_new_tokens: int
    start: int
    new_block_ids: tuple[int, ...] = ()
    full_table: bool = False
    device_block_ids: tuple[int, ...] = ()  # swapping: where its table's blocks sit in the batch's device region

    @property
    def completes_prompt(self) -> bool:
        """After this batch the request's KV covers all its tokens, so a next token is sampled
        (a decode-ahead seq goes one token past them until its previous batch has returned)."""
        return self.start + self.num_new_tokens >= self.request.num_tokens

    @property
    def ahead(self) -> bool:
        """A decode-ahead seq whose input token has not come back yet (`AHEAD` in `token_ids`)."""
        return self.start + self.num_new_tokens > self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(slots=True, eq=False)
class SchedulerOutput:
    """One batch (made by `schedule()`, read by the executor: nothing changes it but a result's
    rejected disk blocks, `tiers.failed`; a slotted class, as one is made per batch). `freed`:
    requests whose blocks were released since the previous batch (finished, aborted or preempted):
    an executor that mirrors block tables drops them before running it.
    `tiers`: the copies between KV tiers the executor performs before the batch's forward (it may
    carry copies with no sequences: an executor runs such an output too)."""

    batch_id: int
    seqs: list[ScheduledSeq]
    preempted: list[Request] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    tiers: TierPlan = field(default_factory=TierPlan)
    swap_region: int = -1  # swapping: the device region the batch computes in (-1: no swapping)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def token_ids(self) -> list[int]:
        """The ids of the tokens the batch computes, sequence after sequence (a forward pass's input)."""
        ids: list[int] = []
        for s in self.seqs:
            r = s.request
            p = len(r.prompt_token_ids)
            ids += r.output_token_ids[s.start - p:s.end - p] if s.start >= p else r.token_ids[s.start:s.end]
            if s.end > p + len(r.output_token_ids):  # a decode-ahead seq: its token is the worker's own last sample
                ids.append(AHEAD)
        return ids

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    # What an executor (the engine, the pipeline executor) does with a batch that came back, asked
    # before it is applied (`Scheduler.update`):

    def sampling_rows(self) -> list[int]:
        """The rows that get a next token from this batch: their request's KV then covers all its
        tokens and it has not finished (one aborted in flight, or, decoding ahead, one that finished
        in the batch before this one gets none: its extra token is discarded)."""
        return [i for i, (req, n, start, _, _, _) in enumerate(self.seqs)  # (a ScheduledSeq's fields, unpacked: cheap)
                if start + n == len(req.prompt_token_ids) + len(req.output_token_ids) and req.status is not FINISHED]

    def finished_before(self) -> set[int]:
        """The `id()`s of this batch's requests that had finished before it came back: decoding ahead,
        they were told when they finished (or aborted), and are not told again."""
        return {id(s[0]) for s in self.seqs if s[0].status is FINISHED}
