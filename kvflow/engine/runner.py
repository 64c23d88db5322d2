"""Turns a scheduler decision into one forward pass over the paged cache, and samples next tokens;
or, decoding ahead, launches a decode step whose next tokens are read back later (`Launched`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvflow.sched.output import AHEAD
from kvflow.sched.sampler import argmax_only, sample_requests
from kvflow.sched.scheduler import SchedulerOutput
from kvflow.kv.cache import KVCache
from kvflow.streaming.tier_store import TierStore
from kvflow.model.cuda_graphs import DecodeGraphs, Launch
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LayerHook, LlamaModel


class Launched(NamedTuple):
    """A decode step on the device whose sampled ids have not been read back: its batch, each
    request's row (what the next step's decode-ahead rows take their input from), and its ids on
    their way to the host."""

    out: SchedulerOutput
    rows: dict[str, int]
    ids: Launch


class ModelRunner:
    """Runs a whole model (all layers) on one device for the single-process engine.

    Contract: `run(out)` first performs the batch's copies between KV tiers (`out.tiers`, through
    `tiers`, recording rejected disk blocks in `out.tiers.failed` for the scheduler), then computes
    the scheduled tokens of every request in `out` (writing their KV) and returns {request_id: next
    token} for the requests that get one (`SchedulerOutput.sampling_rows`).

    Decoding ahead (`graphs.ahead`): `launch(out, prev)` starts a batch that `launchable` accepts and
    returns at once; its decode-ahead rows (`AHEAD`) take the ids the launched batch `prev` samples,
    on the device. `collect(launched)` waits for its ids: {request_id: next token}, as `run`.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, hook: LayerHook | None = None, tiers: TierStore | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("ModelRunner needs a model holding all layers")
        self.model = model
        self.cache = cache  # the KV tensors (the block pool is the scheduler's)
        self.hook = hook
        self.tiers = tiers
        self.device = cache.device
        self.graphs = graphs  # decode-only steps of up to graphs.max_batch requests replay a CUDA graph
        self.launches = 0  # batches launched ahead of the one before's ids

    def prepare(self, out: SchedulerOutput, token_ids: list[int]) -> tuple[torch.Tensor, ForwardBatch]:
        batch = ForwardBatch.of([(s.num_new_tokens, s.end, s.request.block_ids) for s in out.seqs],
                                self.cache.layout.block_size, self.device)
        return torch.tensor(token_ids, dtype=torch.long, device=self.device), batch

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, fed: dict[str, int] | None = None) -> dict[str, int]:
        """`fed`: the ids the batch before sampled, for `out`'s decode-ahead rows (scheduled while that
        batch was in flight, run once it has come back)."""
        if out.tiers:
            assert self.tiers is not None, "a batch with tier copies for an engine without tiers"
            out.tiers.failed = self.tiers.apply(out.tiers)
        if out.is_empty:
            return {}
        token_ids = out.token_ids
        if AHEAD in token_ids:
            self._feed(out, token_ids, fed or {})
        if self._graphed(out):
            logits = self.graphs.run([(s.end, s.request.block_ids) for s in out.seqs], tokens=token_ids)
        else:
            logits = self.model.forward(*self.prepare(out, token_ids), self.cache, self.hook)
        rows = out.sampling_rows()
        if not rows:
            return {}
        reqs = [out.seqs[i].request for i in rows]
        return {r.request_id: t for r, t in zip(reqs, sample_requests(logits if len(rows) == len(out.seqs) else logits[rows], reqs))}

    def launchable(self, out: SchedulerOutput, prev: Launched | None) -> bool:
        """Whether `out` can be launched ahead of `prev`'s ids (None: nothing in flight): graphs built to
        decode ahead, no tier copies, one token per request and no more requests than the graphs
        take, every row that samples a plain argmax (taken on the device), and every decode-ahead
        row's input sampled by `prev`. Anything else runs through `run`, once `prev` is back."""
        g = self.graphs
        if g is None or not g.ahead or self.hook is not None or out.tiers or not 0 < len(out.seqs) <= g.max_batch:
            return False
        for s in out.seqs:
            if s.num_new_tokens != 1:
                return False
            if s.ahead:
                if prev is None or s.request.request_id not in prev.rows:
                    return False
            elif not s.completes_prompt:
                continue  # (a prompt's one-token chunk that samples nothing)
            if not argmax_only(s.request):
                return False
        return True

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: Launched | None) -> Launched:
        """Start `out` (`launchable`) on the device and copy its ids towards the host, without waiting."""
        seqs, tokens = out.seqs, out.token_ids
        sources = None
        if prev is not None:
            sources = [prev.rows[s.request.request_id] if t == AHEAD else -1 for s, t in zip(seqs, tokens)]
        ids = self.graphs.launch([(s.end, s.request.block_ids) for s in seqs], tokens, sources)
        self.launches += 1
        return Launched(out, {s.request.request_id: i for i, s in enumerate(seqs)}, ids)

    def collect(self, launched: Launched) -> dict[str, int]:
        """The ids `launched` sampled for its rows that get a token (`SchedulerOutput.sampling_rows`),
        once they are on the host (asked before the batch is applied)."""
        seqs, ids = launched.out.seqs, launched.ids.read()
        return {seqs[i].request.request_id: ids[i] for i in launched.out.sampling_rows()}

    @staticmethod
    def _feed(out: SchedulerOutput, token_ids: list[int], fed: dict[str, int]) -> None:
        """Put the ids sampled by the batch before into `out`'s `AHEAD` positions (a request that finished
        meanwhile takes any id: its row's result is discarded)."""
        at = 0
        for s in out.seqs:
            at += s.num_new_tokens
            if token_ids[at - 1] == AHEAD:
                t = fed.get(s.request.request_id)
                if t is None and not s.request.is_finished:
                    raise RuntimeError(f"decode-ahead row of {s.request.request_id}: no token sampled for it")
                token_ids[at - 1] = 0 if t is None else t

    def _graphed(self, out: SchedulerOutput) -> bool:
        """Whether `out` replays a decode graph: graphs built, no layer hook, one new token per request."""
        return (self.graphs is not None and self.hook is None and len(out.seqs) <= self.graphs.max_batch
                and all(s.num_new_tokens == 1 for s in out.seqs))
