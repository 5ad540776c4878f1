"""OpenAI-compatible request/response schemas for the policy endpoint (pydantic, as FastAPI wants).

Bad requests raise `OpenAIError` (or fail validation), which the app turns into a 4xx with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.

OpenAI's conventions kept here: `n` choices of one `seed` are independent samples, each with its
own seed hashed from (seed, index), so neighbouring seeds share none; `logprobs` (completions: the
N most likely tokens per position as well, with the sampled one) and `logprobs` + `top_logprobs`
(chat) report log-probs under the distribution the engine sampled from; a stream with
`stream_options: {include_usage: true}` ends with a chunk of empty `choices` and the `usage`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from asyncrl.algo.sampling import choice_seed
from asyncrl.engines.base import SamplingParams
from asyncrl.generation import complete_async, decode, sequence_input
from asyncrl.openai_tools import AssistantToolCall, ToolSpec, call_of, content_before_call
from asyncrl.schema import FinishReason


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
    first = errors[0] if errors else {}
    loc = list(first.get("loc", []))
    if first.get("type") == "json_invalid":
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return f"the body is not valid JSON{where}: {first.get('ctx', {}).get('error', 'malformed')}", None
    return f"invalid request: {first.get('msg', 'malformed body')}", ".".join(str(p) for p in loc[1:]) or None


def check_model_name(requested: str | None, served: str) -> None:
    """An unknown model name is a 404 `model_not_found`, as OpenAI and vLLM answer (omitted: the policy)."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist; this endpoint serves `{served}` "
                               f"(GET /v1/models)", "model", "model_not_found")


MAX_STOP_CHARS = 256
StopText = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
# One request's token positions (prompts x n x (prompt + max_tokens)): what its KV cache and
# logits hold at once. Larger requests are refused with 400 before anything is generated.
MAX_REQUEST_POSITIONS = 1 << 17


def check_request_size(prompt_ids: list[list[int]], n: int, max_tokens: int) -> None:
    positions = n * sum(len(ids) + max_tokens for ids in prompt_ids)
    if positions > MAX_REQUEST_POSITIONS:
        raise OpenAIError(400, f"request too large: {len(prompt_ids)} prompt(s) x n={n} x (prompt + max_tokens) is "
                               f"{positions} token positions; the limit is {MAX_REQUEST_POSITIONS}", "max_tokens")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=0, lt=1 << 62)
    # At most 4 stop strings, as in OpenAI's API, each short: every one is searched in every delta.
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    stream_options: StreamOptions | None = None


# Request size limits: a prompt longer than any context is refused before it is tokenized.
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPTS = 32


PromptText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS)]


class CompletionRequest(_Sampling):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
    # The N most likely tokens per position (and the sampled one); 0: the sampled token's alone.
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=16)  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool's answer: to which call
    name: str | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(None, max_length=64)  # in the trained tool format (openai_tools)
    tool_choice: str | None = None  # auto (the default with tools) or none


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


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


# Below this, logits / temperature overflows float32 (found by fuzzing: 5e-324 gave NaN
# probabilities); such a temperature means greedy anyway.
GREEDY_BELOW_TEMPERATURE = 1e-3


def _params(body: _Sampling, top_logprobs: int = 0) -> SamplingParams:
    greedy = body.temperature < GREEDY_BELOW_TEMPERATURE
    return SamplingParams(temperature=1.0 if greedy else body.temperature, top_p=body.top_p, greedy=greedy,
                          top_logprobs=top_logprobs)


def _choice_seeds(body: _Sampling, prompts: int) -> list[int]:
    """Each choice's sampling seed, prompt-major: choice k of every prompt has seed (seed, k)."""
    seed = body.seed if body.seed is not None else random.randrange(1 << 40)
    return [choice_seed(seed, k) for _ in range(prompts) for k in range(body.n)]


def _alternatives(tokenizer, ids, logprobs) -> list[tuple[str, float]]:
    """(token text, log-prob) of a position's most likely tokens, most likely first; a token the
    sampler's top-p left out (-inf: it cannot be drawn, and JSON has no -inf) is not listed."""
    return [(tokenizer.decode([int(i)]), float(lp)) for i, lp in zip(ids, logprobs) if math.isfinite(lp)]


@dataclass
class Delta:
    """One streamed piece of a choice: its new text, the tokens behind it, their log-probs and
    alternatives (`alternatives[j]`: `_alternatives` of `tokens[j]`), and how the choice ended."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[float]
    alternatives: list[list[tuple[str, float]]]
    finish: str | None


async def stream_choices(engine, tokenizer, prompt_ids: list[list[int]], body: _Sampling, top_logprobs: int = 0):
    """n samples per prompt, streamed token by token as the engine samples them (one decode loop;
    counter-based seeds: the samples are those of `generate_choices`). Yields `Delta`s; finish is
    set on a choice's last one. Text stops at a stop string; decoding stops once every choice has
    ended."""
    stops = [s for s in _stops(body.stop) if s]
    longest_stop = max((len(s) for s in stops), default=0)
    # Incremental detokenisation: each step decodes a few tokens around the new ones (from
    # `prefix`, a token boundary before them), not the whole text so far.
    prompts = [ids for ids in prompt_ids for _ in range(body.n)]
    rows = [{"prompt": np.asarray(ids, dtype=np.int32), "seed": seed, "ids": [], "text": "",
             "prefix": 0, "read": 0, "done": False} for ids, seed in zip(prompts, _choice_seeds(body, len(prompt_ids)))]
    inputs = [sequence_input(r["prompt"], r["seed"], body.max_tokens, []) for r in rows]
    steps = engine.stream_window(inputs, body.max_tokens, _params(body, top_logprobs))
    try:
        async for step in steps:
            for i, token, logprob, reason, top in step:
                row = rows[i]
                if row["done"]:
                    continue  # ended at a stop string while others go on
                row["ids"].append(token)
                finish = None
                if reason is not None:  # WINDOW cannot happen (one window of max_tokens); as length
                    finish = "stop" if reason is FinishReason.EOS else "length"
                before = decode(tokenizer, row["ids"][row["prefix"]:row["read"]])
                after = decode(tokenizer, row["ids"][row["prefix"]:])
                new = after[len(before):] if after.startswith(before) else after
                if new.endswith("\ufffd") and finish is None:
                    new = ""  # an incomplete multi-byte character: wait for the rest
                else:
                    row["prefix"], row["read"] = row["read"], len(row["ids"])
                text = row["text"] + new
                # A stop string can only end inside the new text: search from where it could start.
                start = max(0, len(row["text"]) - longest_stop + 1)
                cuts = [text.find(s, start) for s in stops if s in text[start:]]
                if cuts:
                    text, finish = text[: min(cuts)], "stop"
                delta = text[len(row["text"]):]
                row["text"] = text
                row["done"] = finish is not None
                alternatives = [_alternatives(tokenizer, *top)] if top is not None else []
                yield Delta(i, delta, [token], [logprob], alternatives, finish)
            if all(r["done"] for r in rows):
                return
    finally:
        await steps.aclose()


async def generate_choices(engine, tokenizer, prompt_ids: list[list[int]], body: _Sampling,
                           top_logprobs: int = 0, tool_format=None) -> list[dict]:
    """n samples per prompt in one engine call; text cut at the first stop string, or just after
    a tool call in `tool_format` (a request with tools): then the choice has `tool_calls`."""
    prompts = [ids for ids in prompt_ids for _ in range(body.n)]
    seeds = _choice_seeds(body, len(prompt_ids))
    completions = await complete_async(engine, tokenizer, prompts, seeds, body.max_tokens, _params(body, top_logprobs))
    choices = []
    for index, out in enumerate(completions):
        text = out.text
        finish = "stop" if out.finish_reason is FinishReason.EOS else "length"
        stops = [s for s in _stops(body.stop) if s and s in text]
        if stops:
            # As a stream ends: at the token that completes the first stop string to appear
            # (usage, log-probs), the text before the stop it completed.
            out = _cut(out, tokenizer, lambda seen: any(s in seen for s in stops))
            seen = decode(tokenizer, out.token_ids.tolist())
            text, finish = seen[: min(seen.find(s) for s in stops if s in seen)], "stop"
        calls, content = None, text
        if tool_format is not None:
            end, call = call_of(text, tool_format)
            if call is not None:  # the tokens past the call were sampled, not answered
                text, finish, calls = text[:end], "tool_calls", [call]
                content = content_before_call(text, tool_format)
                out = _cut(out, tokenizer, lambda seen: tool_format.call_end(seen) is not None)
        choices.append({"index": index, "text": text, "content": content, "tool_calls": calls, "finish_reason": finish,
                        "token_logprobs": out.logprobs.tolist(),
                        "tokens": [tokenizer.decode([t]) for t in out.token_ids.tolist()],
                        "alternatives": [_alternatives(tokenizer, ids, lps) for ids, lps in
                                         zip(out.top_ids.tolist(), out.top_logprobs.tolist())] if top_logprobs else [],
                        "completion_tokens": len(out.token_ids), "prompt_tokens": len(prompt_ids[index // body.n]),
                        "first_of_prompt": index % body.n == 0})
    return choices


def _cut(out, tokenizer, reached):
    """A completion cut after its first token whose text so far is `reached` (a stop string or a
    tool call completed): the tokens past it were sampled, not returned."""
    ids = out.token_ids.tolist()
    keep = next((k for k in range(1, len(ids) + 1) if reached(decode(tokenizer, ids[:k]))), len(ids))
    return dataclasses.replace(out, token_ids=out.token_ids[:keep], logprobs=out.logprobs[:keep],
                               top_ids=None if out.top_ids is None else out.top_ids[:keep],
                               top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:keep])


def logprob_entries(tokens: list[str], logprobs: list[float], alternatives: list[list[tuple[str, float]]]) -> list[dict]:
    """Chat-style log-prob entries of the sampled tokens, each with its `top_logprobs` (empty when
    none were asked for)."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in (alternatives[j] if alternatives else [])]}
            for j, (t, lp) in enumerate(zip(tokens, logprobs))]


def completion_logprobs(tokens: list[str], logprobs: list[float], alternatives: list[list[tuple[str, float]]],
                        asked: int) -> dict:
    """The completions API's `logprobs` object. With `logprobs=N` > 0, `top_logprobs` maps each
    position's N most likely tokens, and the sampled one, to their log-probs (OpenAI: "up to
    logprobs+1 elements")."""
    top = None
    if asked:
        top = [{**dict(alts), token: lp} for token, lp, alts in zip(tokens, logprobs, alternatives)]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": None}


def _usage(choices: list[dict]) -> dict:
    prompt = sum(c["prompt_tokens"] for c in choices if c["first_of_prompt"])  # each prompt once, not per sample
    completion = sum(c["completion_tokens"] for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(request_id: str, model: str, choices: list[dict], version: int,
                        asked: int | None = None) -> dict:
    """`asked`: what `logprobs_asked` returned (None: no log-probs)."""
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "weight_version": version,
        "choices": [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                     "logprobs": completion_logprobs(c["tokens"], c["token_logprobs"], c["alternatives"], asked)
                     if asked is not None else None}
                    for c in choices],
        "usage": _usage(choices),
    }


def chat_response(request_id: str, model: str, choices: list[dict], version: int, asked: int | None = None) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "weight_version": version,
        "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["content"],
                                                      **({"tool_calls": c["tool_calls"]} if c["tool_calls"] else {})},
                     "finish_reason": c["finish_reason"],
                     "logprobs": {"content": logprob_entries(c["tokens"], c["token_logprobs"], c["alternatives"])}
                     if asked is not None else None}
                    for c in choices],
        "usage": _usage(choices),
    }


def stream_chunk(request_id: str, model: str, version: int, chat: bool, index: int, delta: str,
                 finish: str | None, logprobs: dict | None = None, first: bool = False) -> dict:
    """One server-sent chunk. In chat, a choice's first delta carries the role (and no text), as
    OpenAI's do; later deltas carry only content."""
    created = int(time.time())
    if chat:
        message = {"role": "assistant", "content": ""} if first else {"content": delta}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "weight_version": version,
                "choices": [{"index": index, "delta": message, "finish_reason": finish, "logprobs": logprobs}]}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "weight_version": version,
            "choices": [{"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs}]}


def usage_chunk(request_id: str, model: str, version: int, chat: bool, prompt_ids: list[list[int]],
                completion_tokens: int) -> dict:
    """A stream's last chunk with `stream_options.include_usage`: no choices, the request's usage
    (each prompt counted once, as in `_usage`)."""
    prompt = sum(len(ids) for ids in prompt_ids)
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "weight_version": version, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                      "total_tokens": prompt + completion_tokens}}


async def stream_events(engine, tokenizer, prompt_ids: list[list[int]], body: _Sampling, chat: bool,
                        request_id: str, model: str, version: int, asked: int | None):
    """Server-sent events of a streamed request: in chat, each choice's role first; then a chunk
    per text delta of a choice as its tokens are sampled; with `include_usage`, every chunk carries
    `usage: null` and a last chunk the usage (OpenAI's shape); then `data: [DONE]`."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def event(chunk: dict) -> str:
        if include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n"

    if chat:
        for index in range(len(prompt_ids) * body.n):
            yield event(stream_chunk(request_id, model, version, True, index, "", None, first=True))
    completion_tokens = 0
    async for d in stream_choices(engine, tokenizer, prompt_ids, body, asked or 0):
        completion_tokens += len(d.tokens)
        lp = None
        if asked is not None:
            texts = [tokenizer.decode([t]) for t in d.tokens]
            lp = ({"content": logprob_entries(texts, d.logprobs, d.alternatives)} if chat
                  else completion_logprobs(texts, d.logprobs, d.alternatives, asked))
        if d.text or d.finish or lp:
            yield event(stream_chunk(request_id, model, version, chat, d.index, d.text, d.finish, lp))
    if include_usage:
        usage = usage_chunk(request_id, model, version, chat, prompt_ids, completion_tokens)
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
