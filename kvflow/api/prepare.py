"""Turns a parsed request body into prompt token ids and `SamplingParams`, enforcing the context limits
with the scheduler's own admission checks (`kvflow.sched.admission`).

Every problem becomes an `APIError` (400, or 404 `model_not_found`) that names the offending field.
Tokenization and chat templating can take seconds for a huge prompt, so the server runs `prepare_*`
in a worker thread, never on the event loop. A prompt longer than one piece (`piece_chars`) is first
counted piece by piece and refused as soon as the count passes the context (`check_length`): the rest
of it is never tokenized, and no list of millions of token ids is ever built.
Default `max_tokens` when the client omits it: the rest of the context, capped at
`DEFAULT_MAX_TOKENS` (256), so a request without it can never overflow the context.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvflow.api.errors import APIError, bad_request, invalid_request
from kvflow.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvflow.model.tokenizer import Tokenizer
from kvflow.sched.admission import CONTEXT_LENGTH_EXCEEDED, InvalidRequest, Limits, check_params, check_prompt
from kvflow.sched.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256
PIECE_CHARS_PER_TOKEN = 8  # a piece tokenized at a time holds this many characters per context token ...
MIN_PIECE_CHARS = 4096  # ... and at least this many
CUT_SLACK_TOKENS = 16  # how many tokens more than the whole text a cut between two pieces may count
_CUT = re.compile(r"\S(?=\s)")  # a cut goes where whitespace begins: where pre-tokenizers split too


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str  # the field a backend's complaint about the prompt is reported against
    max_tokens_param: str = "max_tokens"  # the field the client sent max_tokens in
    return_token_ids: bool = False  # completions only: answer with the token ids beside the text
    kv_source: str | None = None  # completions only: an instance to pull the prompt's KV from (`kv_transfer_params`)


def piece_chars(max_model_len: int) -> int:
    """Characters of prompt text tokenized at a time when counting a long prompt: far more than the context
    holds in usual text, so a prompt that fits is one piece, and one that does not is found in the first."""
    return max(MIN_PIECE_CHARS, PIECE_CHARS_PER_TOKEN * max_model_len)


def prompt_chars(req: CompletionRequest | ChatCompletionRequest) -> int:
    """The prompt's characters (or token ids): what tokenizing it will cost, known before tokenizing."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
                   for m in req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p) if p and isinstance(p[0], (str, list)) else len(p)


def token_id_prompt(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """The prompt is token ids (a completion's list of ints, or one such list in a list): preparing it tokenizes
    nothing, only checks the ids (`check_prompt`)."""
    if isinstance(req, ChatCompletionRequest) or isinstance(req.prompt, str):
        return False
    p = req.prompt
    return not p or isinstance(p[0], int) or (isinstance(p[0], list) and len(p) == 1)


def pieces(texts: Iterable[str], size: int) -> Iterator[str]:
    """The texts in pieces of about `size` characters: short texts joined by newlines, a long one cut where a
    run of whitespace begins within `size` characters past a piece's end, else right at it."""
    held: list[str] = []
    held_chars = 0
    for text in texts:
        start = 0
        while len(text) - start > size:
            m = _CUT.search(text, start + size - 1, start + 2 * size)
            end = m.end() if m else start + size
            if held:
                yield "\n".join(held)
                held, held_chars = [], 0
            yield text[start:end]
            start = end
        rest = text[start:] if start else text
        if held_chars + len(rest) > size and held:
            yield "\n".join(held)
            held, held_chars = [], 0
        held.append(rest)
        held_chars += len(rest) + 1
    if held:
        yield "\n".join(held)


def check_length(tokenizer: Tokenizer, texts: list[str], max_model_len: int) -> None:
    """Raise `InvalidRequest` (context_length_exceeded) once the texts have passed `max_model_len` tokens,
    counting them piece by piece (`pieces`) and tokenizing nothing after that piece. Texts of one piece
    are left to the caller's tokenization. The count may exceed the whole text's by `CUT_SLACK_TOKENS` per
    cut (a word cut in two, a piece's own start), so a prompt is refused only past the context plus that."""
    size = piece_chars(max_model_len)
    if sum(len(t) for t in texts) <= size:
        return
    base = len(tokenizer.encode(""))  # what encode adds to every call (a BOS, say)
    counted = chars = 0
    for n, piece in enumerate(pieces(texts, size)):
        counted += len(tokenizer.encode(piece)) - base
        chars += len(piece)
        if counted >= max_model_len + n * CUT_SLACK_TOKENS:
            raise InvalidRequest("prompt", f"has more than {max_model_len} tokens in its first {chars} characters (the "
                                 f"rest was not tokenized), leaving no room to generate: this model's maximum context "
                                 f"length is {max_model_len} tokens", CONTEXT_LENGTH_EXCEEDED)


def check_model(req: SamplingFields, model_name: str) -> None:
    if req.model != model_name:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")


def _reject_unsupported(req: SamplingFields) -> None:
    if req.n != 1:
        raise bad_request(f"n must be 1 (only one choice per request is supported), got {req.n}", "n")
    if req.best_of not in (None, 1):
        raise bad_request("best_of is not supported", "best_of")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def completion_prompt(req: CompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt must be a single prompt (batches are not supported), got {len(p)}", "prompt")
        p = p[0]
    if isinstance(p, str) and p:
        _checked_length(tokenizer, [p], max_model_len, "prompt")
        return tokenizer.encode(p)
    return list(p)  # token ids (an empty prompt: the admission check's)


def _checked_length(tokenizer: Tokenizer, texts: list[str], max_model_len: int, prompt_param: str) -> None:
    try:
        check_length(tokenizer, texts, max_model_len)
    except InvalidRequest as e:
        raise invalid_request(e, prompt_param) from e


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported", "logprobs")
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in req.messages]
    _checked_length(tokenizer, [m["content"] for m in messages], max_model_len, "messages")
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
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
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
    completion = isinstance(req, CompletionRequest)
    kv = req.kv_transfer_params if completion else None
    return Prepared(ids, params, req.stream, bool(req.stream_options and req.stream_options.include_usage), prompt_param,
                    max_tokens_param, completion and req.return_token_ids, kv.source if kv is not None else None)


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
    ids = completion_prompt(req, tokenizer, max_model_len)
    return _prepared(req, ids, req.max_tokens, Limits(max_model_len, vocab_size), "prompt", "max_tokens")


def prepare_chat(req: ChatCompletionRequest, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 vocab_size: int | None) -> Prepared:
    check_model(req, model_name)
    _reject_unsupported(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    ids = chat_prompt(req, tokenizer, max_model_len)
    return _prepared(req, ids, getattr(req, which), Limits(max_model_len, vocab_size), "messages", which)
