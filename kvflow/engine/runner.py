"""Turns a scheduler decision into one forward pass over the paged cache, and samples next tokens."""

from __future__ import annotations

import torch

from kvflow.sched.sampler import sample_requests
from kvflow.sched.scheduler import SchedulerOutput
from kvflow.kv.cache import KVCache
from kvflow.streaming.tier_store import TierStore
from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LayerHook, LlamaModel


class ModelRunner:
    """Runs a whole model (all layers) on one device for the single-process engine.

    Contract: `run(out)` first performs the batch's copies between KV tiers (`out.tiers`, through
    `tiers`, recording rejected disk blocks in `out.tiers.failed` for the scheduler), then computes
    the scheduled tokens of every request in `out` (writing their KV) and returns {request_id: next
    token} for the requests whose KV now covers all their tokens.
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

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        batch = ForwardBatch.of([(s.num_new_tokens, s.end, s.request.block_ids) for s in out.seqs],
                                self.cache.layout.block_size, self.device)
        return torch.tensor(out.token_ids, dtype=torch.long, device=self.device), batch

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[str, int]:
        if out.tiers:
            assert self.tiers is not None, "a batch with tier copies for an engine without tiers"
            out.tiers.failed = self.tiers.apply(out.tiers)
        if out.is_empty:
            return {}
        if self._graphed(out):
            logits = self.graphs.run([(s.end, s.request.block_ids) for s in out.seqs], tokens=out.token_ids)
        else:
            token_ids, batch = self.prepare(out)
            logits = self.model.forward(token_ids, batch, self.cache, self.hook)
        rows = [i for i, s in enumerate(out.seqs) if s.completes_prompt]
        if not rows:
            return {}
        reqs = [out.seqs[i].request for i in rows]
        return {r.request_id: t for r, t in zip(reqs, sample_requests(logits if len(rows) == len(out.seqs) else logits[rows], reqs))}

    def _graphed(self, out: SchedulerOutput) -> bool:
        """Whether `out` replays a decode graph: graphs built, no layer hook, one new token per request."""
        return (self.graphs is not None and self.hook is None and len(out.seqs) <= self.graphs.max_batch
                and all(s.num_new_tokens == 1 for s in out.seqs))
