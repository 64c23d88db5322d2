"""The single-process engine: add requests, then `step()` = schedule, run, update."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvflow.sched.output import SchedulerOutput
from kvflow.sched.request import Request, RequestOutput
from kvflow.model import cuda_graphs
from kvflow.engine import memory
from kvflow.engine.runner import Launched, ModelRunner
from kvflow.sched.sampling import SamplingParams
from kvflow.config import EngineConfig
from kvflow.sched.admission import Limits, validate
from kvflow.sched.scheduler import Scheduler
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.streaming.tier_store import TierStore
from kvflow.model.llama import LayerHook, LlamaModel
from kvflow.model.loader import load_checkpoint
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    directory: Path  # HF-style directory the weights and tokenizer were read from
    load_seconds: float
    converted: bool  # True when this load converted a GGUF file (cold load)


class LLMEngine:
    """Continuous-batching engine over one `LlamaModel` holding all layers.

    Contract: `add_request` validates and queues (raising ValueError for input that can never run);
    each `step()` advances every scheduled request by one forward pass and returns an output for
    every request that produced a token or finished; `abort_request` frees a request's blocks.

    Decoding ahead (`EngineConfig.decode_ahead`, where decode steps replay graphs): a step launches the
    next batch (greedy decodes one token past the batch in flight, their input ids taken on the
    device: `SchedulerConfig.decode_ahead`) before it reads the batch in flight's ids back and
    applies them, so the host's work of a step runs while the device computes the next one. A step
    then returns the outputs of the batch launched by the step before. The tokens are the serial
    engine's: a request that finishes in the batch in flight has its extra token discarded, and its
    blocks are freed when that comes back (also after an abort); any other batch (prompts, sampled
    rows, tier copies, more requests than the graphs take) runs serially, after the batch in flight.
    """

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, config: EngineConfig, hook: LayerHook | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        mcfg = model.cfg
        self.max_model_len = config.model_len(mcfg.max_position_embeddings)
        layout = KVLayout.for_model(mcfg, 1, config.block_size, dtype=config.torch_dtype)
        if config.gpu_memory_utilization is None:
            num_blocks = config.kv_blocks(layout.bytes_per_block)
        else:  # what the device has left for KV once the weights and a full step are accounted
            tokens = min(config.scheduler.max_num_batched_tokens, self.max_model_len)
            mem = memory.measure(model, config.block_size, tokens, config.torch_dtype)
            num_blocks = memory.kv_budget_bytes(mem, config.gpu_memory_utilization) // layout.bytes_per_block
        layout = KVLayout.for_model(mcfg, num_blocks, config.block_size, dtype=config.torch_dtype)
        self.kv_cache = KVCache(layout, config.device)
        tiers = config.tier_sizes(layout.bytes_per_block)
        host, disk = tiers.pools()
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, host, disk)
        sched = config.scheduler
        ahead = (config.decode_ahead and not config.enforce_eager and hook is None and sched.policy == "continuous"
                 and not sched.swap_regions)
        self.limits = Limits(self.max_model_len, mcfg.vocab_size)
        store = None
        if host is not None:
            store = TierStore(self.kv_cache, host.num_slots, disk.num_slots if disk else 0, config.disk_kv_path)
        graphs = None
        if not config.enforce_eager and hook is None:
            graphs = cuda_graphs.capture(model, self.kv_cache, sched.max_num_seqs, self.max_model_len, ahead=ahead)
        self.runner = ModelRunner(model, self.kv_cache, hook, store, graphs)
        self.decode_ahead = ahead and graphs is not None and graphs.ahead  # (one batch in flight at most)
        sched = replace(sched, decode_ahead=self.decode_ahead, max_in_flight=1) if self.decode_ahead else sched
        self.scheduler = Scheduler(sched, self.kv_manager, self.max_model_len)
        self._in_flight: Launched | None = None  # decoding ahead: the batch launched whose ids are not read yet
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.checkpoint: CheckpointInfo | None = None  # set by from_config

    @classmethod
    def from_config(cls, config: EngineConfig = EngineConfig()) -> "LLMEngine":
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        ck = load_checkpoint(config.model)
        log.info("loaded %s in %.2fs (%s)", ck.config.name, ck.load_seconds, "converted" if ck.converted else "cached")
        model = LlamaModel.from_state_dict(ck.config, ck.state_dict, dtype=config.torch_dtype, device=config.device,
                                           deterministic=config.deterministic)
        tokenizer = Tokenizer(ck.directory) if Tokenizer.available(ck.directory) else None
        if tokenizer is None:
            log.warning("%s has no tokenizer: prompts must be token ids", ck.directory)
        engine = cls(model, tokenizer, config)
        engine.checkpoint = CheckpointInfo(ck.directory, ck.load_seconds, ck.converted)
        return engine

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("a prompt must be a string or a list of token ids")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    kv_source: str | None = None) -> Request:
        """`kv_source`: the base URL of another instance that computed this prompt (the router's prefill instance):
        its full blocks are pulled from there before admission, where this engine has a host tier to pull into."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in self.scheduler.in_flight:  # (a finished one's extra step still out)
            raise ValueError(f"request id {rid!r} is already in use")
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        req = Request(rid, self.encode_prompt(prompt), params, self.eos_token_ids, detok)
        req.kv_source = kv_source if self.runner.tiers is not None else None
        validate(req, self.limits, [self.kv_manager])
        self.scheduler.add(req)
        self.requests[rid] = req
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        tiers = self.runner.tiers
        if tiers is not None and tiers.pulling:  # KV pulled from other instances in the background: findable now
            for ops, failed in tiers.take_pulled():
                self.kv_manager.pulls_done(ops, failed)
        prev, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        runner = self.runner
        if self.decode_ahead:
            if prev is None and runner.launchable(batch, None):  # start a pipeline: this batch, then its successor
                prev, batch = runner.launch(batch, None), self.scheduler.schedule()
            if prev is not None and runner.launchable(batch, prev):
                self._in_flight = runner.launch(batch, prev)  # (on the device behind `prev`, before its ids are read)
        outputs, fed = [], {}
        if prev is not None:
            fed = runner.collect(prev)
            outputs = self._apply(prev.out, fed)
        if self._in_flight is None:  # the serial path: `batch` runs now (its decode-ahead rows take `fed`)
            sampled = runner.run(batch, fed)
            if batch.is_empty and prev is None and tiers is not None and tiers.pulling:
                tiers.wait_pulls(0.01)  # nothing to run but a pull to wait for: wait on it rather than spin
            outputs += self._apply(batch, sampled)
        return outputs

    def _apply(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Apply a batch that came back; the outputs of its requests that were not told already (decoding
        ahead, a request that finished, or was aborted, before this batch came back)."""
        told = out.finished_before()
        outputs = []
        for r in self.scheduler.update(out, sampled):
            if id(r) in told:
                continue
            outputs.append(r.take_output())
            if r.is_finished and self.requests.get(r.request_id) is r:
                del self.requests[r.request_id]
        return outputs
