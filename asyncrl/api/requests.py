"""OpenAI-compatible requests to the policy endpoint (pydantic, as FastAPI wants), and what each
field asks of the engine.

Bad requests raise `OpenAIError` (or fail validation), which the app turns into a 4xx with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}`. Every field OpenAI defines is
either honoured or refused by name: a request never gets silently less than it asked for.

* Honoured: sampling (`temperature`, `top_p`, `seed`, `n`, `stop`, and vLLM's `top_k` and `min_p`,
  which clients send as `extra_body`), the length
  (`max_completion_tokens`, or its older name `max_tokens`; chat without one: what is left of the
  context, capped at `serve.max_response_tokens`; legacy completions without one: 16, as OpenAI's),
  `presence_penalty`, `frequency_penalty`, `logit_bias`, log-probs, streaming with usage, tools
  (`asyncrl.api.tools`); asyncrl's own `min_weight_version` and `weight_version` (the weights an
  answer must come from: waited for up to `serve.version_wait_s`, else 409; an exact version that
  an update replaced during a whole answer is a 409 too, the answer not given); on a
  vision-language model, a user message's `image_url` parts (`asyncrl.api.images`: a base64 data
  URL, or a file under `serve.image_files_from`; `detail` is accepted and ignored, the model's
  image processor sizes every image alike).
* Accepted because they ask for nothing the answer must show: `user`, `safety_identifier`,
  `prompt_cache_key`, `parallel_tool_calls` (at most one call per choice satisfies either value),
  and the defaults of the fields below.
* Refused unless at their default (400 naming the field): `response_format` other than text,
  `store`, `metadata`, `service_tier` other than auto/default, `modalities` other than text,
  `reasoning_effort`, `verbosity`, `audio`, `prediction`, `web_search_options`, the legacy
  `functions`/`function_call`; completions' `echo`, `suffix`, `best_of` other than n. Any field
  OpenAI does not define is refused by name too.
* Content parts other than `text` and `image_url` (`input_audio`, `file`, ...) are refused naming
  the part's type; so are image parts to a text-only model, or to an engine other than the
  embedded one (SGLang, vLLM), and `image_url`s of the network (`http(s)://`: never fetched).

OpenAI's conventions kept here: `n` choices of one `seed` are independent samples, each with its
own seed hashed from (seed, index), so neighbouring seeds share none; `logprobs` (completions: the
N most likely tokens per position as well, with the sampled one) and `logprobs` + `top_logprobs`
(chat) report log-probs under the distribution the engine sampled from (after penalties and bias).
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from asyncrl.algo.sampling import choice_seed
from asyncrl.api.tools import AssistantToolCall, ToolChoice, ToolSpec
from asyncrl.engines.base import SamplingParams


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def describe_invalid_request(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of a request FastAPI could not validate: the first error's field as
    `param`, or for a body that is not JSON, the character where parsing failed in the message."""
    # The deepest error is the most specific: a content part's own, not "should be a string" of
    # `content`'s other form.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    loc = list(first.get("loc", []))
    if first.get("type") == "json_invalid":
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return f"the body is not valid JSON{where}: {first.get('ctx', {}).get('error', 'malformed')}", None
    where = [str(p) for p in loc[1:] if not (isinstance(p, str) and "[" in p)]  # not pydantic's union branches
    return f"invalid request: {first.get('msg', 'malformed body')}", ".".join(where) or None


def check_model_name(requested: str | None, served: str) -> None:
    """An unknown model name is a 404 `model_not_found`, as OpenAI and vLLM answer (omitted: the policy)."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist; this endpoint serves `{served}` "
                               f"(GET /v1/models)", "model", "model_not_found")


MAX_STOP_CHARS = 256
StopText = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
# A prompt longer than any context is refused before it is tokenized (the body limit,
# serve.max_body_mb, comes first: before the body is read).
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPTS = 32
PromptText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS)]
# The legacy completions API's default length (OpenAI's and vLLM's).
COMPLETIONS_DEFAULT_TOKENS = 16

# Fields accepted because they ask for nothing the answer shows; fields refused unless at their default.
_ACCEPTED = {"user", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"}
_DEFAULTS: dict[str, tuple] = {
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "verbosity": (None,), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "functions": (None,), "function_call": (None,),
    "response_format": (None, {"type": "text"}), "echo": (None, False), "suffix": (None, ""),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


class _Sampling(BaseModel):
    """What chat and legacy completions share. Unknown fields are kept (`extra`) to be refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1 << 20)  # vLLM's: -1 or 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=0, lt=1 << 62)
    # At most 4 stop strings, as in OpenAI's API, each short: every one is searched in every delta.
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=300)
    # asyncrl's: the weights an answer must come from (a version at least this, or exactly this).
    min_weight_version: int | None = Field(None, ge=0)
    weight_version: int | None = Field(None, ge=0)

    def refuse_unhonoured(self) -> None:
        """A 400 naming the first field this endpoint would not honour (see the module's lists)."""
        for name, value in (self.model_extra or {}).items():
            if name in _ACCEPTED:
                continue
            if name not in _DEFAULTS:
                raise OpenAIError(400, f"Unrecognized request argument supplied: {name}", name)
            if value not in _DEFAULTS[name]:
                raise OpenAIError(400, f"{name}={value!r} is not supported by this endpoint (the policy "
                                       f"generates plain text)", name)


class CompletionRequest(_Sampling):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
    # The N most likely tokens per position (and the sampled one); 0: the sampled token's alone.
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=16)

    def refuse_unhonoured(self) -> None:
        super().refuse_unhonoured()
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, "best_of other than n is not supported (every sample is returned)", "best_of")


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., min_length=1)  # a data URL, or a file path (`asyncrl.api.images`)
    detail: Literal["auto", "low", "high"] = "auto"  # accepted and ignored: one processor sizes every image


class ContentPart(BaseModel):
    """One part of a message's `content`: text, or an image (`image_url`); any other kind is
    validated loosely and refused by name (`refuse_unread`), so the 400 names the part's type."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    image_url: ImageURL | None = None

    def refuse_unread(self, param: str, role: str) -> None:
        """A 400 for a part this endpoint does not read: a kind other than text and image_url, a
        part without its payload, an image outside a user message, an image URL of the network."""
        if self.type == "text":
            if self.text is None:
                raise OpenAIError(400, 'a text part needs its text ({"type": "text", "text": ...})', param)
            return
        if self.type != "image_url":
            raise OpenAIError(400, f"a content part of type {self.type!r} is not supported: this endpoint reads "
                                   f"text and image_url parts only", param)
        if self.image_url is None:
            raise OpenAIError(400, 'an image_url part needs its image_url ({"url": ...})', param)
        if role != "user":
            raise OpenAIError(400, f"image_url parts are read in user messages only, not in a {role} message", param)
        named = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", self.image_url.url)
        scheme = named.group(1).lower() if named else ""
        if scheme in ("http", "https"):
            raise OpenAIError(400, "image_url: an http(s) URL is never fetched from the network; send the image "
                                   "as a data URL (data:image/png;base64,...)", f"{param}.image_url.url")
        if scheme not in ("", "file"):
            raise OpenAIError(400, f"image_url: a {scheme}:// URL is not read; send a data URL "
                                   f"(data:image/png;base64,...)", f"{param}.image_url.url")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=256)] | None = Field(None, max_length=MAX_PROMPT_CHARS)
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=16)  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool's answer: to which call
    name: str | None = Field(None, max_length=64)  # a participant's name (templates mostly leave it out)
    refusal: str | None = Field(None, max_length=MAX_PROMPT_CHARS)  # an assistant's earlier refusal, as text

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    @property
    def text(self) -> str:
        """The content as one text (parts joined, as OpenAI concatenates them); developer is system."""
        if isinstance(self.content, list):  # (image parts: the caller puts the model's image tokens in their place)
            return "".join(part.text or "" for part in self.content)
        return self.content if self.content is not None else (self.refusal or "")

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(None, max_length=64)
    tool_choice: ToolChoice | None = None

    def refuse_unhonoured(self) -> None:
        super().refuse_unhonoured()
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                part.refuse_unread(f"messages[{i}].content[{j}]", message.role)


def logprobs_asked(body: _Sampling, chat: bool) -> int | None:
    """The alternatives per token a request asks for (0: the sampled token's log-prob alone), or
    None for no log-probs; a malformed combination is a 400."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream: true", "stream_options")
    if not chat:
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def requested_tokens(body: _Sampling) -> tuple[int | None, str]:
    """The length a request names (None: none) and the field that named it."""
    newer = getattr(body, "max_completion_tokens", None)
    if newer is not None and body.max_tokens is not None and newer != body.max_tokens:
        raise OpenAIError(400, f"max_completion_tokens={newer} and max_tokens={body.max_tokens} disagree: "
                               "send one (max_tokens is its older name)", "max_completion_tokens")
    if newer is not None:
        return newer, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def response_tokens(body: _Sampling, prompt_ids: list[list[int]], context: int, cap: int, chat: bool) -> int:
    """How many tokens each choice may generate: the request's own length, or by default (chat)
    what is left of the context after the longest prompt, at most `cap`. A prompt that leaves no
    room, or a length over the cap or the context, is a 400 naming the field."""
    asked, param = requested_tokens(body)
    longest = max(len(ids) for ids in prompt_ids)
    if any(not ids for ids in prompt_ids):
        raise OpenAIError(400, "the prompt is empty", "messages" if chat else "prompt")
    if asked is None and not chat:
        asked = COMPLETIONS_DEFAULT_TOKENS
    if asked is not None and asked > cap:
        raise OpenAIError(400, f"{param}={asked} is over this endpoint's limit of {cap} tokens "
                               "(serve.max_response_tokens)", param)
    left = context - longest
    if left < 1 or (asked is not None and asked > left):
        raise OpenAIError(400, f"prompt ({longest} tokens) + {param} ({asked if asked is not None else 1}) exceeds the "
                               f"model's context of {context} tokens", param)
    return asked if asked is not None else min(left, cap)


# Below this, logits / temperature overflows float32 (found by fuzzing: 5e-324 gave NaN
# probabilities); such a temperature means greedy anyway.
GREEDY_BELOW_TEMPERATURE = 1e-3


def sampling_of(body: _Sampling, top_logprobs: int, vocab_size: int) -> SamplingParams:
    """The engine's sampling settings for a request; a `logit_bias` key that is not a token id of
    this vocabulary is a 400."""
    greedy = body.temperature < GREEDY_BELOW_TEMPERATURE
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,9}", key) or int(key) >= vocab_size:
            raise OpenAIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab_size - 1})",
                              "logit_bias")
        bias.append((int(key), float(value)))
    return SamplingParams(temperature=1.0 if greedy else body.temperature, top_p=body.top_p, greedy=greedy,
                          top_k=max(body.top_k, 0), min_p=body.min_p,
                          top_logprobs=top_logprobs, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, logit_bias=tuple(sorted(bias)))


def choice_seeds(body: _Sampling, prompts: int) -> list[int]:
    """Each choice's sampling seed, prompt-major: choice k of every prompt has seed (seed, k)."""
    seed = body.seed if body.seed is not None else random.randrange(1 << 40)
    return [choice_seed(seed, k) for _ in range(prompts) for k in range(body.n)]


def stops_of(body: _Sampling) -> list[str]:
    stop: Any = body.stop
    return [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]
