"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode step of a small model on a GPU is bound by the host: a few hundred kernel launches and a
dozen small host-to-device copies per step take far longer than the kernels themselves. A CUDA graph
replays the whole forward with one launch. Its inputs must sit at fixed addresses, so every input of
a decode step (token ids, positions, KV slots, block table, context lengths) lives in one
preallocated device buffer, filled from one pinned host buffer with one copy per step; the graph of
the smallest bucket that holds the step's rows replays; its logits rows for the real requests are
read back.

A bucket's spare rows repeat the step's last real row (same token, position, slot and context): they
write the same K/V into the same slot and their outputs are ignored, so padding changes nothing.

The model may hold a layer range (a pipeline stage): a first stage takes token ids, a later one the
hidden states [rows, hidden] of the stage before (copied into a fixed buffer); a last stage returns
logits, an earlier one its hidden states (a buffer the next replay overwrites: send it first).

Decoding ahead (`ahead=True`, a whole model: the single-process engine): each step also takes the
argmax of every row's logits into a fixed device buffer (`argmax_ids`), and a row may take its
input token from that buffer (`sources`: the row of the previous step whose argmax it feeds in)
instead of from the host. The gather is part of the graph, so a step can be launched before the
previous step's ids have been read back: the host never waits for them to start the next one.
`launch` runs a step and starts its ids' copy to the host (`Launch`: read them later). The engine
and a pipeline of one stage (a worker holding every layer) decode ahead through it.

Without CUDA (`capture=False`) the same buffers feed the same forward eagerly: the bookkeeping
(packing, padding, the batch built over the buffers) is what the CPU tests check against the
ordinary forward.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvflow.kv.cache import KVCache
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LlamaModel

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
FIELDS = 5  # per-row int64 fields of the packed metadata: token, position, slot, context length, source

log = logging.getLogger(__name__)


class Launch(NamedTuple):
    """A step's argmax ids on their way to the host (`DecodeGraphs.launch`): `read()` waits for them."""

    ids: torch.Tensor  # page-locked on CUDA: the copy lands while the host goes on
    event: torch.cuda.Event | None  # recorded after the copy (None off CUDA: the step ran eagerly)
    rows: int

    def wait(self) -> None:
        """Until the ids are on the host (the GIL released meanwhile)."""
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> list[int]:
        self.wait()
        return self.ids[:self.rows].tolist()


def capture(model: LlamaModel, cache: KVCache, max_batch: int, max_model_len: int,
            float_logits: bool = True, ahead: bool = False) -> "DecodeGraphs | None":
    """The graphs an engine or a pipeline stage on CUDA runs its decode steps on; None off CUDA, or
    when capturing fails (logged: the steps then run eagerly, slower and still correct). Tests set
    KVFLOW_TEST_DECODE_BUFFERS=1 to run the same buffers eagerly on the CPU (worker processes too)."""
    on_cuda = cache.device.type == "cuda"
    if not on_cuda and os.environ.get("KVFLOW_TEST_DECODE_BUFFERS") != "1":
        return None
    try:
        return DecodeGraphs(model, cache, max_batch, max_model_len, capture=on_cuda, float_logits=float_logits, ahead=ahead)
    except RuntimeError as e:  # e.g. an op that cannot be captured
        log.warning("capturing CUDA graphs failed (%s); decode steps run eagerly", e)
        return None


class DecodeGraphs:
    """Decode-only steps of `model`'s layers over `cache`, for up to `max_batch` requests of at most
    `max_model_len` tokens. `run(contexts, tokens | hidden)` -> logits [rows, vocab] (float32, or the
    model's dtype with `float_logits=False`) on a last stage, else hidden states [rows, hidden].
    `ahead` (a whole model): `run(..., sources=)` and `argmax_ids` (see the module docstring)."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_batch: int, max_model_len: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capture: bool | None = None, float_logits: bool = True,
                 ahead: bool = False) -> None:
        if ahead and not (model.is_first and model.is_last):
            raise ValueError("decoding ahead through the graphs needs a model holding all layers")
        self.model, self.cache, self.float_logits, self.ahead = model, cache, float_logits, ahead
        self.device = cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.block_size = cache.layout.block_size
        self.width = -(-max_model_len // self.block_size)  # block-table columns: any request fits
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        n = self.buckets[-1]
        # one int64 buffer: tokens, positions, slots, context lengths, sources [n each], then the block table
        # [n, width]; packed in one of two page-locked host buffers in turn (decoding ahead, a step is packed
        # while the copy of the one before may not have run yet)
        self._cols = FIELDS + self.width
        self._hosts = [torch.zeros(n * self._cols, dtype=torch.long, pin_memory=self.capture) for _ in range(2)]
        self._turn = 0
        self._dev = torch.zeros(n * self._cols, dtype=torch.long, device=self.device)
        tokens, positions, slots, ctx, src = self._dev[: FIELDS * n].view(FIELDS, n)
        table = self._dev[FIELDS * n:].view(n, self.width)
        self._tokens, self._ctx, self._src = tokens, ctx, src
        # decoding ahead: each step's argmax per row, which the next step's `sources` rows take in
        self._ids = torch.zeros(n, dtype=torch.long, device=self.device) if ahead else None
        # ... and their copies on the host, two in turn (a launched step's ids are read after the next launch)
        self._id_hosts = [(torch.zeros(n, dtype=torch.long, pin_memory=self.capture),
                           torch.cuda.Event() if self.capture else None) for _ in range(2 if ahead else 0)]
        self._id_turn = 0
        self._last_rows = 0  # rows of the step before (what `sources` may name)
        self._hidden = None if model.is_first else torch.zeros(n, model.cfg.hidden_size, dtype=model.layers[0].input_norm.dtype,
                                                               device=self.device)
        rows = torch.arange(n, device=self.device)
        ones = torch.ones(n, dtype=torch.long, device=self.device)
        # padded keys for the PyTorch attention fallback (the kernels read the context lengths instead)
        self._span = torch.arange(self.width * self.block_size, device=self.device)
        self._mask = torch.zeros(n, 1, 1, self.width * self.block_size, dtype=torch.bool, device=self.device)
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self._batches = {
            b: ForwardBatch(
                seqs=[], block_size=self.block_size, positions=positions[:b], slot_mapping=slots[:b],
                logits_idx=rows[:b], decode_rows=rows[:b], decode_block_table=table[:b], decode_key_mask=self._mask[:b],
                decode_context_lens=ctx[:b], decode_query_len=ones[:b], prefill=[],
                prefill_block_table=empty.view(0, 0), prefill_query_start=empty, prefill_query_len=empty,
                prefill_context_lens=empty,
            )
            for b in self.buckets
        }
        model.reserve_rope(max_model_len)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, torch.Tensor] = {}
        if self.capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode graph step takes 1..{self.max_batch} requests, got {n}")
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    @torch.inference_mode()
    def run(self, contexts: Sequence[tuple[int, Sequence[int]]], tokens: Sequence[int] | None = None,
            hidden: torch.Tensor | None = None, sources: Sequence[int] | None = None) -> torch.Tensor:
        """One decode step: request i is at position context_len - 1, where `contexts[i]` is
        (context_len after the step, its block ids in order), and feeds `tokens[i]` (a first stage) or
        row i of `hidden` (a later one); with `ahead`, `sources[i]` >= 0 feeds in the argmax of that
        row of the step before instead (its `tokens[i]` is ignored). Asynchronous on CUDA: the
        returned logits (and `argmax_ids`) are valid until the next step."""
        n = len(contexts)
        first = self._hidden is None
        if (tokens is None, hidden is None) != (not first, first):
            raise ValueError("a first stage takes tokens, a later stage hidden states")
        if (tokens is not None and len(tokens) != n) or (hidden is not None and hidden.shape[0] != n):
            raise ValueError("one context per row")
        if sources is not None:
            if not self.ahead:
                raise ValueError("sources need graphs built to decode ahead (ahead=True)")
            if len(sources) != n or any(not -1 <= s < self._last_rows for s in sources):
                raise ValueError(f"one source per row, each -1 or a row of the step before (< {self._last_rows})")
        b = self.bucket(n)
        self._pack(tokens if tokens is not None else [0] * n, contexts, b, sources)
        self._last_rows = n
        if hidden is not None:
            self._hidden[:n].copy_(hidden, non_blocking=True)
            self._hidden[n:b].copy_(hidden[n - 1:].expand(b - n, -1), non_blocking=True)
        if not self.capture:
            torch.lt(self._span, self._ctx[:b, None], out=self._mask[:b, 0, 0])
            return self._forward(b)[:n]
        self._graphs[b].replay()
        return self._out[b][:n]

    def launch(self, contexts: Sequence[tuple[int, Sequence[int]]], tokens: Sequence[int],
               sources: Sequence[int] | None = None) -> Launch:
        """(`ahead`, a whole model) `run` a step and copy its rows' argmax towards the host without
        waiting: what the next step's `sources` name and the host reads back (`Launch.read`) after
        launching that one. At most two launches may be unread at a time."""
        self.run(contexts, tokens=tokens, sources=sources)
        ids, event = self._id_hosts[self._id_turn]
        self._id_turn ^= 1
        n = len(contexts)
        ids[:n].copy_(self.argmax_ids(n), non_blocking=True)
        if event is not None:
            event.record()
        return Launch(ids, event, n)

    def argmax_ids(self, n: int) -> torch.Tensor:
        """(`ahead`) The argmax of each of the first `n` rows of the latest step's logits, on the device
        (overwritten by the next step: copy it out first)."""
        if self._ids is None:
            raise ValueError("argmax ids need graphs built to decode ahead (ahead=True)")
        return self._ids[:n]

    def replay_ms(self, n: int, reps: int = 50) -> float:
        """GPU milliseconds of one replay of the graph `n` rows take: `reps` replays back to back between
        CUDA events, the step's device time without its host work (benchmarks). Each replay repeats
        the last step run, writing the same K/V into the same slots."""
        if not self.capture:
            raise ValueError("no captured graphs to time")
        graph = self._graphs[self.bucket(n)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def _forward(self, b: int) -> torch.Tensor:
        m, batch = self.model, self._batches[b]
        if self._hidden is not None:
            h = self._hidden[:b]
        elif self._ids is not None:  # rows with a source take the step before's argmax (read before it is overwritten)
            src = self._src[:b]
            h = m.embed(torch.where(src < 0, self._tokens[:b], self._ids[src.clamp(min=0)]))
        else:
            h = m.embed(self._tokens[:b])
        h = m.run_layers(h, batch, self.cache)
        if not m.is_last:
            return h
        logits = m.logits(h, batch, self.float_logits)
        if self._ids is not None:
            torch.argmax(logits, dim=-1, out=self._ids[:b])
        return logits

    def _pack(self, tokens: Sequence[int], contexts: Sequence[tuple[int, Sequence[int]]], b: int,
              sources: Sequence[int] | None = None) -> None:
        """Fill the first `b` rows of every field (rows n..b-1 repeat row n-1) and copy them over at once."""
        n, full, bs, w = len(tokens), self.max_batch, self.block_size, self.width
        src = sources if sources is not None else (-1,) * n
        buf = self._hosts[self._turn]
        self._turn ^= 1
        host = buf.numpy()
        fields = host[: FIELDS * full].reshape(FIELDS, full)
        table = host[FIELDS * full:].reshape(full, w)
        for i, (tok, (ctx, blocks), s) in enumerate(zip(tokens, contexts, src)):
            used = -(-ctx // bs)
            if ctx < 1 or len(blocks) < used or used > w:
                raise ValueError(f"request {i}: {len(blocks)} blocks for a context of {ctx} tokens (at most {w} blocks)")
            pos = ctx - 1
            fields[:, i] = (tok, pos, blocks[pos // bs] * bs + pos % bs, ctx, s)
            table[i, :used] = blocks[:used]
            table[i, used:] = blocks[0]
        fields[:, n:b] = fields[:, n - 1: n]
        table[n:b] = table[n - 1]
        # (asynchronous: this buffer is packed again two steps later, by when the caller has waited for
        # this step's results, its logits or its ids, which the stream computes after this copy)
        self._dev[: FIELDS * full].copy_(buf[: FIELDS * full], non_blocking=True)
        self._dev[FIELDS * full: FIELDS * full + b * w].copy_(buf[FIELDS * full: FIELDS * full + b * w], non_blocking=True)

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (as vLLM does: the largest
        graph's allocations are reused by the smaller ones). Each is warmed up eagerly first (Triton
        compiles, cuBLAS picks its kernels), on a side stream as capture requires."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        dummy = [(1, [0])] * self.max_batch
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._pack([0] * b, dummy[:b], b)  # token 0 at position 0 of block 0: a slot any pool has
                for _ in range(2):
                    self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._out[b] = self._forward(b)
                pool = graph.pool()
                self._graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
