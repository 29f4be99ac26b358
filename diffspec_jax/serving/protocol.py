"""The OpenAI API's request and response bodies (pydantic models) and its error body.

Requests follow the OpenAI completions and chat completions APIs, plus the sampling keys vLLM adds (``top_k``,
``stop_token_ids``, ``ignore_eos``). Fields this server does not implement (``logprobs``, ``echo``, ``suffix``,
penalties, ``n`` other than 1, ``response_format`` other than text, ...) are refused with HTTP 400 when set to
anything but their neutral value, and so is every key a request model does not declare (``extra="forbid"``; the
other endpoint's fields, such as ``max_completion_tokens`` on completions, get a message saying so:
:data:`FIELD_HINTS`), as the OpenAI API and vLLM refuse them: a client is never answered as if a field it sent had
been applied. Types are strict (``"0.5"`` is not a number,
``true`` is not an integer). Every number must fit the type the device holds it in (:data:`INT32_MAX`,
:data:`FLOAT32_MAX`; no NaN or infinity), and every string must be valid Unicode (no lone surrogate such as
``"\\ud800"``, which no tokenizer can encode): a request outside these is a 400 naming the field, never a failure in
the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from diffspec_jax.errors import InputError

#: stop strings per request (OpenAI allows 4)
MAX_STOP_STRINGS = 16
#: the largest integer a request may give: token ids, counts and top-k are int32 on the device
INT32_MAX = 2 ** 31 - 1
#: the largest temperature: sampling parameters are float32 on the device
FLOAT32_MAX = 3.4028234663852886e38


def _valid_unicode(text: str) -> str:
    """``text`` unless it holds a lone surrogate (JSON's ``"\\ud800"``: no UTF-8 form, so no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is "
                         f"not valid Unicode; send well-formed UTF-8") from None
    return text


#: a string field: valid Unicode
Text = Annotated[str, AfterValidator(_valid_unicode)]
#: an int32 count (>= 1)
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
#: a token id (int32 >= 0; the vocabulary is checked where the model is known)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: an integer that only has to fit int32 (fields refused unless neutral: n, logprobs, best_of, ...)
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body (``headers`` added to the response)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


#: what the 400 for a key a request does not take says, for keys a client may well send (the other endpoint's
#: fields, OpenAI's tool calling, vLLM's further sampling keys); any other key gets :func:`unknown_field`'s message
FIELD_HINTS = {
    "max_completion_tokens": "max_completion_tokens is a /v1/chat/completions field; /v1/completions takes "
                             "max_tokens",
    "echo": "echo is a /v1/completions field (not supported there either)",
    "suffix": "suffix is a /v1/completions field (not supported there either)",
    "best_of": "best_of is a /v1/completions field (only 1 is supported there)",
    "top_logprobs": "top_logprobs is a /v1/chat/completions field (logprobs are not supported)",
    **{k: f"{k}: tool and function calling are not supported" for k in (
        "tool_choice", "parallel_tool_calls", "functions", "function_call")},
    **{k: f"{k} is not supported (this server samples with temperature, top_p, top_k, seed and stops only)"
       for k in ("min_p", "repetition_penalty", "length_penalty", "min_tokens", "use_beam_search")},
}


def unknown_field(path: str) -> str:
    """The message of the 400 for a key that a request (or a part of it, at ``path``: ``foo``,
    ``stream_options.foo``) does not take."""
    return FIELD_HINTS.get(path, f"unknown field {path!r}: this server does not take it (docs/serving.md lists the "
                                 f"fields of each endpoint)")


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """``response_format``: only ``{"type": "text"}`` (plain text, the default) is served."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: Text


class _SamplingRequest(_Strict):
    """The keys completions and chat completions share."""

    model: Text | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    #: any 64-bit seed, signed or not (as :class:`~diffspec_jax.serving.scheduler.SamplingParams` takes it)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 64 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI's ranges (refused unless 0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    user: Text | None = None

    def check_supported(self) -> None:
        """:class:`APIError` (400) for keys set to something this server does not do."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request (n=1)",
                           param="n")
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key) not in (None, 0, 0.0):
                raise APIError(400, f"{key} is not supported (leave it unset or 0)", param=key)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"response_format {self.response_format.type!r} is not supported: this server "
                                f"generates plain text (no JSON mode, no structured outputs); leave response_format "
                                f"out or use type 'text'", param="response_format")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is text or token ids (one prompt per request)."""

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    echo: bool = False
    suffix: Text | None = None
    logprobs: Int32 | None = None
    best_of: Int32 | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported (only 1)", param="best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one text or one id list counts as it)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request, got a batch of {len(p)} (send them as separate "
                                    f"requests: they are batched on the server)", param="prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class ContentPart(_Strict):
    """A part of a message's content; its other keys (``image_url``, ...) are let through, so that a part of
    another type is refused for its type (:meth:`ChatMessage.text`)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: Text
    text: Text | None = None


class ChatMessage(_Strict):
    """One message; ``content`` is required (this server has no tool calls, the one case OpenAI lets it be null)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: Text
    content: Text | list[ContentPart]
    name: Text | None = None

    def text(self, param: str = "messages") -> str:
        """The message's text (text parts joined; other part types are refused, a text part needs its ``text``;
        ``param`` names the message in errors)."""
        if isinstance(self.content, str):
            return self.content
        for i, part in enumerate(self.content):
            if part.type != "text":
                raise APIError(400, f"message content parts of type {part.type!r} are not supported (text only)",
                               param="messages")
            if part.text is None:
                raise APIError(400, f"{param}.content.{i} is a text part without its 'text' string",
                               param=f"{param}.content.{i}.text")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        out = []
        for i, m in enumerate(self.messages):
            d = {"role": m.role, "content": m.text(f"messages.{i}")}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out


#: why a choice ended: an EOS or stop id or string, ``max_tokens``, or the server aborting it as it shuts down
FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V came from the prefix cache
    (not prefilled)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def input_error(exc: InputError, param: str | None = None) -> APIError:
    """A library :class:`InputError` as a 400 (``context_length_exceeded`` for a request too long)."""
    message = str(exc)
    code = "context_length_exceeded" if "maximum context length" in message else None
    return APIError(400, message, param=param, code=code)
