"""Turns a parsed request body into prompt token ids and `SamplingParams`, enforcing the context limits.

Every problem becomes an `APIError` (400, or 404 `model_not_found`) that names the offending field.
Tokenization and chat templating can take seconds for a huge prompt, so the server runs `prepare_*`
in a worker thread, never on the event loop.
Default `max_tokens` when the client omits it: the rest of the context, capped at
`DEFAULT_MAX_TOKENS` (256), so a request without it can never overflow the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.api.errors import APIError, bad_request, param_of
from kvflow.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvflow.sched.sampling import SamplingParams
from kvflow.model.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str  # the field a backend's complaint about the prompt is reported against


def check_model(req: SamplingFields, model_name: str) -> None:
    if req.model != model_name:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")


def _reject_unsupported(req: SamplingFields) -> None:
    if req.n != 1:
        raise bad_request(f"n must be 1 (only one choice per request is supported), got {req.n}", "n")
    if req.best_of not in (None, 1):
        raise bad_request("best_of is not supported", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def completion_prompt(req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int | None) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt must be a single prompt (batches are not supported), got {len(p)}", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt is empty", "prompt")
        return tokenizer.encode(p)
    ids = list(p)
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return ids


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported", "logprobs")
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in req.messages]
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise bad_request(str(e), "messages") from e


def sampling_params(req: SamplingFields, max_tokens: int | None, prompt_len: int, max_model_len: int,
                    prompt_param: str, vocab_size: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
    """Validates lengths against the context, then builds `SamplingParams` (its ValueError -> 400)."""
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in req.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{prompt_len} tokens, leaving no room to generate", prompt_param, "context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
                          f"tokens and {max_tokens_param} is {max_tokens} (total {prompt_len + max_tokens})", max_tokens_param,
                          "context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop or (),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
        )
    except ValueError as e:
        message, param = str(e), param_of(str(e))
        if param == "max_tokens":  # the chat field the client actually sent
            message, param = max_tokens_param + message[len(param):], max_tokens_param
        raise bad_request(message, param) from e


def prepare_completion(req: CompletionRequest, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                       vocab_size: int | None) -> Prepared:
    check_model(req, model_name)
    _reject_unsupported(req)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.logprobs is not None:
        raise bad_request("logprobs are not supported", "logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    ids = completion_prompt(req, tokenizer, vocab_size)
    params = sampling_params(req, req.max_tokens, len(ids), max_model_len, "prompt", vocab_size)
    return Prepared(ids, params, req.stream, bool(req.stream_options and req.stream_options.include_usage), "prompt")


def prepare_chat(req: ChatCompletionRequest, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 vocab_size: int | None) -> Prepared:
    check_model(req, model_name)
    _reject_unsupported(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    ids = chat_prompt(req, tokenizer)
    params = sampling_params(req, getattr(req, which), len(ids), max_model_len, "messages", vocab_size, which)
    return Prepared(ids, params, req.stream, bool(req.stream_options and req.stream_options.include_usage), "messages")
