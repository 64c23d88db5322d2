"""Attention metadata of one forward step: which tokens belong to which sequence and where their KV goes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a forward step.

    `query_len` new tokens (rows query_start .. query_start+query_len of the flattened batch) sit at
    positions context_len-query_len .. context_len-1; after the step the sequence's KV holds
    `context_len` tokens, stored in `block_ids` (in order, block_size tokens each).
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.query_len <= 0 or self.context_len < self.query_len:
            raise ValueError(f"bad sequence slice: query_len={self.query_len}, context_len={self.context_len}")


@dataclass
class ForwardBatch:
    """Flattened tokens of several sequences plus the indices attention needs (built by `build`).

    Decode-shaped sequences (query_len == 1) are attended in one batch straight from the paged cache
    (block table + context lengths; the padded key mask serves the gather fallback); longer queries
    (prompt chunks) too, by the CPU kernel (their own block table, chunk rows and context lengths),
    else one sequence at a time.
    """

    seqs: list[SeqSlice]
    block_size: int
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset
    logits_idx: torch.Tensor  # [num_seqs] row of each sequence's last token
    decode_rows: torch.Tensor  # [Bd] token rows of decode-shaped sequences
    decode_block_table: torch.Tensor  # [Bd, max_blocks] long (padded with the sequence's first block)
    decode_key_mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend
    decode_context_lens: torch.Tensor  # [Bd] long: tokens each decode sequence attends to
    decode_query_len: torch.Tensor  # [Bd] long: ones (the query length of each decode row, for kernels that take one)
    prefill: list[SeqSlice]
    prefill_block_table: torch.Tensor  # [Sp, max_blocks] long, per prompt-chunk sequence (padded like decode's)
    prefill_query_start: torch.Tensor  # [Sp] long: first token row of each chunk
    prefill_query_len: torch.Tensor  # [Sp] long
    prefill_context_lens: torch.Tensor  # [Sp] long: cached tokens after the step (the chunk is the last)
    _splits: dict = field(default_factory=dict, repr=False, compare=False)  # prompt_bands', per bounds

    def prompt_bands(self, mid_from: int | None, long_from: int | None):
        """The prompt chunks in three bands by length, computed once per step for all its layers:
        (the metadata (block table, query starts, query lengths, context lengths) of the chunks of
        `mid_from` tokens or more but fewer than `long_from`, None if none; the indices into `prefill`
        of the chunks of `long_from` tokens or more; the metadata of the others, None if none). A
        bound of None is never reached."""
        key = (mid_from, long_from)
        if key not in self._splits:
            def band(lo: int | None, hi: int | None) -> list[int]:
                return [i for i, s in enumerate(self.prefill)
                        if lo is not None and s.query_len >= lo and (hi is None or s.query_len < hi)]

            long = band(long_from, None)
            mid = band(mid_from, long_from)
            short = [i for i in range(len(self.prefill)) if i not in long and i not in mid]
            self._splits[key] = (self._meta(mid), long, self._meta(short))
        return self._splits[key]

    def _meta(self, rows: list[int]) -> tuple[torch.Tensor, ...] | None:
        meta = (self.prefill_block_table, self.prefill_query_start, self.prefill_query_len, self.prefill_context_lens)
        if not rows:
            return None
        if len(rows) == len(self.prefill):
            return meta
        return tuple(t.index_select(0, torch.tensor(rows, dtype=torch.long, device=t.device)) for t in meta)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def of(cls, seqs: Iterable[tuple[int, int, Sequence[int]]], block_size: int,
           device: torch.device | str = "cpu") -> "ForwardBatch":
        """`build` over sequences given in batch order as (query_len, context_len, block_ids): each
        one's token rows follow the previous one's."""
        slices, start = [], 0
        for query_len, context_len, block_ids in seqs:
            slices.append(SeqSlice(start, query_len, context_len, tuple(block_ids)))
            start += query_len
        return cls.build(slices, block_size, device)

    @classmethod
    def build(cls, seqs: list[SeqSlice], block_size: int, device: torch.device | str = "cpu") -> "ForwardBatch":
        positions: list[int] = []
        slots: list[int] = []
        expected = 0
        for s in seqs:
            if s.query_start != expected:
                raise ValueError("sequence slices must tile the batch in order")
            expected += s.query_len
            if len(s.block_ids) * block_size < s.context_len:
                raise ValueError(f"{len(s.block_ids)} blocks cannot hold {s.context_len} tokens")
            first = s.context_len - s.query_len
            for p in range(first, s.context_len):
                positions.append(p)
                slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
        decode = [s for s in seqs if s.query_len == 1]
        prefill = [s for s in seqs if s.query_len > 1]
        table, max_blocks = _block_table(decode, block_size)
        span = torch.arange(max_blocks * block_size)
        ctx = torch.tensor([s.context_len for s in decode], dtype=torch.long)
        mask = (span[None, :] < ctx[:, None])[:, None, None, :]
        dev = torch.device(device)
        long = dict(dtype=torch.long, device=dev)
        prefill_table, prefill_blocks = _block_table(prefill, block_size)
        return cls(
            seqs=list(seqs),
            block_size=block_size,
            positions=torch.tensor(positions, **long),
            slot_mapping=torch.tensor(slots, **long),
            logits_idx=torch.tensor([s.query_start + s.query_len - 1 for s in seqs], **long),
            decode_rows=torch.tensor([s.query_start for s in decode], **long),
            decode_block_table=torch.tensor(table, **long).reshape(len(decode), max_blocks),
            decode_key_mask=mask.to(dev),
            decode_context_lens=ctx.to(dev),
            decode_query_len=torch.ones(len(decode), **long),
            prefill=prefill,
            prefill_block_table=torch.tensor(prefill_table, **long).reshape(len(prefill), prefill_blocks),
            prefill_query_start=torch.tensor([s.query_start for s in prefill], **long),
            prefill_query_len=torch.tensor([s.query_len for s in prefill], **long),
            prefill_context_lens=torch.tensor([s.context_len for s in prefill], **long),
        )


def _block_table(seqs: list[SeqSlice], block_size: int) -> tuple[list[list[int]], int]:
    """The blocks holding each sequence's context, rows padded with the row's first block -> (rows, width)."""
    width = max((-(-s.context_len // block_size) for s in seqs), default=0)
    rows = [list(s.block_ids[: -(-s.context_len // block_size)]) for s in seqs]
    return [row + [row[0]] * (width - len(row)) for row in rows], width
