"""Request and response bodies of /v1/completions and /v1/chat/completions (pydantic, OpenAI field names).

Requests are validated strictly: no type coercion (`true`, `"5"` or `5.0` where an integer is
required is an error naming the field; a number where a bool is required too), no NaN/Infinity,
and every string must be valid Unicode (a lone surrogate such as `"\\ud800"` is an error). Unknown
fields are ignored, as OpenAI-compatible servers do. Fields we cannot honour with a non-default
value (n > 1, logprobs, logit_bias, echo, suffix, tools) are rejected with a 400 by
`kvflow.api.prepare`, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlparse
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_SEED = 2**64 - 1  # what a torch.Generator accepts


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_unicode", "is not valid Unicode (a lone surrogate at character {pos})",
                                  {"pos": e.start}) from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "{what} must be a string", {"what": what})
    return _valid_unicode(value)


def _token_ids(value: list, what: str) -> list[int]:
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise PydanticCustomError("int_type", "{what}[{i}] must be an integer token id", {"what": what, "i": i})
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"stream": null` (OpenAI's schema allows null for optional fields) means the default, not an error."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by both endpoints. `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
    `stop_token_ids` are extensions (as vLLM)."""

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None  # checked by `_stop` (one clear error instead of one per union member)
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    best_of: int | None = None
    user: Text | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, _handler) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value if value is None else _valid_unicode(value)
        if not isinstance(value, list):
            raise PydanticCustomError("stop_type", "must be a string or a list of strings")
        return [_text(v, f"stop[{i}]") for i, v in enumerate(value)]


class KVTransferParams(_Body):
    """Extension (vLLM's field name, our own content): where the prompt's KV was computed — the base URL of the
    instance to pull its blocks from (the router's prefill instance), http(s)://host:port."""

    source: Text

    @field_validator("source")
    @classmethod
    def _url(cls, value: str) -> str:
        u = urlparse(value)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
            raise PydanticCustomError("kv_source", "must be an instance's base URL, http(s)://host:port")
        try:
            u.port
        except ValueError:
            raise PydanticCustomError("kv_source", "has a bad port") from None
        return value.rstrip("/")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]  # checked by `_prompt`
    return_token_ids: bool = False  # extension (as vLLM): each choice also carries its `token_ids` (the router needs them)
    kv_transfer_params: KVTransferParams | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, _handler) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, str):
            return _valid_unicode(value)
        if not isinstance(value, list):
            raise PydanticCustomError("prompt_type", "must be a string, a list of token ids, or a one-element list of either")
        if value and all(isinstance(v, str) for v in value):
            return [_text(v, f"prompt[{i}]") for i, v in enumerate(value)]
        if value and all(isinstance(v, list) for v in value):
            return [_token_ids(v, f"prompt[{i}]") for i, v in enumerate(value)]
        return _token_ids(value, "prompt")


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # checked by `_content`
    name: Text | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler) -> str | list[TextPart] | None:
        if value is None or isinstance(value, str):
            return value if value is None else _valid_unicode(value)
        if not isinstance(value, list):
            raise PydanticCustomError("content_type", "must be a string or a list of text parts")
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or "text" not in part:
                raise PydanticCustomError("content_part", "part {i} must be {\"type\": \"text\", \"text\": ...} "
                                          "(only text content is supported)", {"i": i})
            _text(part["text"], f"content[{i}].text")
        return handler(value)

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing_content", "a {role} message needs content", {"role": self.role})
        return self

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionChoiceWithIds(CompletionChoice):
    """A choice of a request sent with `return_token_ids`: the token ids its `text` was decoded from (a stream
    chunk's new ones, or the whole output)."""

    token_ids: list[int]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]  # a `CompletionChoiceWithIds` keeps its token_ids
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelPermission(BaseModel):
    """As vLLM lists it (clients written against vLLM read `permission`)."""

    id: str = Field(default_factory=lambda: new_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = False
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """OpenAI's model object plus vLLM's fields (`root`, `parent`, `max_model_len`, `permission`)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvflow"
    root: str | None = None  # the checkpoint served under `id`
    parent: str | None = None
    max_model_len: int  # extension (as vLLM): the context length
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])
    vocab_size: int | None = None  # extension: lets the load generator draw synthetic token-id prompts


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
