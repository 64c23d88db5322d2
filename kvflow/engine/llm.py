"""The offline Python API: `LLM(...).generate(prompts, SamplingParams)`, `.chat(messages)`, `.stream(...)`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from kvflow.config import EngineConfig, default_block_size, resolve_dtype

from kvflow.engine.engine import LLMEngine
from kvflow.sched.request import RequestOutput
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.config import OFFLINE_TOKEN_BUDGET  # offline nobody waits on a token: a larger budget than the server's
from kvflow.sched.scheduler import SchedulerConfig
from kvflow.model.tokenizer import Message

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Loads a model (default: the embedded SmolLM2-135M-Instruct) and generates with continuous batching.

    Keyword arguments are `EngineConfig` fields (dtype, device, block_size, kv_cache_memory_gb,
    num_kv_blocks, max_model_len, num_threads) or `SchedulerConfig` fields (max_num_seqs,
    max_num_batched_tokens, prefill_chunk_size). dtype defaults to "auto": bfloat16 where the CPU
    (or GPU) has native bf16, float32 elsewhere; `float32` is the reference mode. block_size defaults
    to `default_block_size` (128 tokens on CPU, 16 on CUDA). The token budget defaults to
    `OFFLINE_TOKEN_BUDGET` (both budget fields, unless either is given).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        eng_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "scheduler"}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)} - eng_fields  # (decode_ahead: the engine's)
        unknown = set(kwargs) - sched_fields - eng_fields
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {sorted(unknown)}")
        kwargs.setdefault("dtype", "auto")
        kwargs.setdefault("block_size", default_block_size(kwargs.get("device", "cpu")))
        dtype, why = resolve_dtype(kwargs["dtype"], kwargs.get("device", "cpu"))
        log.info("dtype %s (%s)", dtype, why)
        kwargs["dtype"] = dtype
        if "max_num_batched_tokens" not in kwargs and "prefill_chunk_size" not in kwargs:
            kwargs.update(max_num_batched_tokens=OFFLINE_TOKEN_BUDGET, prefill_chunk_size=OFFLINE_TOKEN_BUDGET)
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_fields})
        config = EngineConfig(model=model, scheduler=sched, **{k: v for k, v in kwargs.items() if k in eng_fields})
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        self = cls.__new__(cls)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        return self

    # ------------------------------------------------------------------ batch
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (raw text or token ids); results in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = [self.engine.encode_prompt(p) for p in prompts]  # validate all before queueing any
        return self._run(ids, params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in convs]
        return self._run(ids, _as_params_list(sampling_params, len(ids)), use_tqdm)

    def _run(self, ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        reqs = []
        try:
            for p, sp in zip(ids, params):
                reqs.append(self.engine.add_request(p, sp))
        except ValueError:
            for r in reqs:
                self.engine.abort_request(r.request_id)
            raise
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        bar = _progress(len(reqs), use_tqdm)
        generated = 0
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        generated += len(out.token_ids)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{generated} tokens")
        finally:
            if bar is not None:
                bar.close()
        assert all(r is not None for r in results), "a request ended without a final output"
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ streaming
    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yield outputs (with `new_text`/`new_token_ids` deltas) as tokens are produced; the last has finished=True.

        With chat=True, `prompt` is a user message (str) or a message list and the chat template is applied.
        """
        if chat:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if self.tokenizer is None:
                raise ValueError("chat needs a tokenizer with a chat template")
            ids = self.tokenizer.apply_chat_template(msgs)
        else:
            ids = self.engine.encode_prompt(prompt)
        req = self.engine.add_request(ids, sampling_params)
        try:
            while not req.is_finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.is_finished:
                self.engine.abort_request(req.request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _progress(total: int, enabled: bool):
    if not enabled or total <= 1:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
