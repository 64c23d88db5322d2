"""Turns a parsed request body into prompt token ids and `SamplingParams`, enforcing the context limits
with the scheduler's own admission checks (`kvflow.sched.admission`).

Every problem becomes an `APIError` (400, or 404 `model_not_found`) that names the offending field.
Tokenization and chat templating can take seconds for a huge prompt, so the server runs `prepare_*`
in a worker thread, never on the event loop.
Default `max_tokens` when the client omits it: the rest of the context, capped at
`DEFAULT_MAX_TOKENS` (256), so a request without it can never overflow the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.api.errors import APIError, bad_request, invalid_request
from kvflow.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvflow.model.tokenizer import Tokenizer
from kvflow.sched.admission import InvalidRequest, Limits, check_params, check_prompt
from kvflow.sched.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str  # the field a backend's complaint about the prompt is reported against
    max_tokens_param: str = "max_tokens"  # the field the client sent max_tokens in


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


def completion_prompt(req: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt must be a single prompt (batches are not supported), got {len(p)}", "prompt")
        p = p[0]
    return tokenizer.encode(p) if isinstance(p, str) and p else list(p)  # (an empty one: the admission check's)


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


def sampling_params(req: SamplingFields, max_tokens: int | None, prompt: list[int], limits: Limits) -> SamplingParams:
    """Checks the prompt against the limits, then builds `SamplingParams` and checks them (raises `InvalidRequest`)."""
    check_prompt(prompt, limits)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_model_len - len(prompt))
    params = SamplingParams(
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
    check_params(params, len(prompt), limits)
    return params


def _prepared(req: SamplingFields, ids: list[int], max_tokens: int | None, limits: Limits, prompt_param: str,
              max_tokens_param: str) -> Prepared:
    try:
        params = sampling_params(req, max_tokens, ids, limits)
    except InvalidRequest as e:
        raise invalid_request(e, prompt_param, max_tokens_param) from e
    return Prepared(ids, params, req.stream, bool(req.stream_options and req.stream_options.include_usage), prompt_param,
                    max_tokens_param)


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
    ids = completion_prompt(req, tokenizer)
    return _prepared(req, ids, req.max_tokens, Limits(max_model_len, vocab_size), "prompt", "max_tokens")


def prepare_chat(req: ChatCompletionRequest, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 vocab_size: int | None) -> Prepared:
    check_model(req, model_name)
    _reject_unsupported(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    ids = chat_prompt(req, tokenizer)
    return _prepared(req, ids, getattr(req, which), Limits(max_model_len, vocab_size), "messages", which)
