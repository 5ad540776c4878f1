"""The policy endpoint's answers, built from the `openai` package's own response types (so their
shape is OpenAI's by construction), each tagged with the weight version that answered
(`weight_version`, an extra field the types keep).

A stream is server-sent events: in chat, each choice's first chunk carries the role (and no
text), as OpenAI's do; then a chunk per delta with its content, its log-probs, and a tool call as
`delta.tool_calls` (whole: its id, name and arguments in one chunk); the last chunk of a choice
its `finish_reason`. With `stream_options.include_usage`, every chunk carries `usage: null` and a
last chunk with no choices the usage; then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from asyncrl.api.choices import ChoiceText, Delta


def as_json(model) -> dict:
    """A response object as OpenAI sends it: the fields set (null where set to None), extras kept."""
    return model.model_dump(mode="json", exclude_unset=True)


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def token_logprobs(texts: list[str], logprobs: list[float], alternatives: list[list[tuple[str, float]]]
                   ) -> list[ChatCompletionTokenLogprob]:
    """Chat log-prob entries of the sampled tokens, each with its `top_logprobs` (empty unless asked)."""
    def top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    return [ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")),
                                       top_logprobs=[top(a, alp) for a, alp in (alternatives[j] if alternatives else [])])
            for j, (t, lp) in enumerate(zip(texts, logprobs))]


def completion_logprobs(texts: list[str], logprobs: list[float], alternatives: list[list[tuple[str, float]]],
                        asked: int) -> CompletionLogprobs:
    """The completions API's `logprobs`: with `logprobs=N` > 0, `top_logprobs` maps each position's
    N most likely tokens, and the sampled one, to their log-probs (OpenAI: "up to logprobs+1")."""
    top = [{**dict(alts), t: lp} for t, lp, alts in zip(texts, logprobs, alternatives)] if asked else None
    return CompletionLogprobs(tokens=texts, token_logprobs=logprobs, top_logprobs=top, text_offset=None)


def _tool_calls(call: dict | None) -> list[ChatCompletionMessageFunctionToolCall] | None:
    return None if call is None else [ChatCompletionMessageFunctionToolCall.model_validate(call)]


class Answer:
    """What a whole (not streamed) answer gathers per choice from its deltas."""

    def __init__(self, count: int):
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.alternatives: list[list[list[tuple[str, float]]]] = [[] for _ in range(count)]

    def add(self, delta: Delta) -> None:
        self.texts[delta.index] += delta.token_texts
        self.logprobs[delta.index] += delta.logprobs
        self.alternatives[delta.index] += delta.alternatives

    def chat(self, request_id: str, model: str, choices: list[ChoiceText], prompt_tokens: int, version: int,
             asked: int | None) -> dict:
        out = [ChatChoice(index=c.index, finish_reason=c.finish or "length",
                          message=ChatCompletionMessage(role="assistant", content=c.content,
                                                        **({"tool_calls": _tool_calls(c.tool_call)} if c.tool_call else {})),
                          logprobs=None if asked is None else ChoiceLogprobs(content=token_logprobs(
                              self.texts[c.index], self.logprobs[c.index], self.alternatives[c.index])))
               for c in choices]
        return as_json(ChatCompletion(id=request_id, object="chat.completion", created=int(time.time()), model=model,
                                      choices=out, usage=usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
                                      weight_version=version))

    def completion(self, request_id: str, model: str, choices: list[ChoiceText], prompt_tokens: int, version: int,
                   asked: int | None) -> dict:
        out = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish or "length",
                                logprobs=None if asked is None else completion_logprobs(
                                    self.texts[c.index], self.logprobs[c.index], self.alternatives[c.index], asked))
               for c in choices]
        return as_json(Completion(id=request_id, object="text_completion", created=int(time.time()), model=model,
                                  choices=out, usage=usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
                                  weight_version=version))


class Chunks:
    """The server-sent events of one streamed request (see the module's docstring)."""

    def __init__(self, request_id: str, model: str, chat: bool, asked: int | None, include_usage: bool):
        self.request_id, self.model, self.chat, self.asked, self.include_usage = request_id, model, chat, asked, include_usage
        self.created = int(time.time())

    def _event(self, chunk) -> str:
        payload = as_json(chunk)
        if self.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n"

    def role(self, index: int, version: int) -> str:
        return self._event(ChatCompletionChunk(
            id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model,
            weight_version=version,
            choices=[ChunkChoice(index=index, delta=ChoiceDelta(role="assistant", content=""), finish_reason=None,
                                 logprobs=None)]))

    def delta(self, d: Delta, version: int) -> str | None:
        """The chunk of one delta (None when it carries nothing: held-back text, no log-probs asked)."""
        if not (d.content or d.finish or d.tool_call or (self.asked is not None and d.tokens)):
            return None
        if not self.chat:
            logprobs = (completion_logprobs(d.token_texts, d.logprobs, d.alternatives, self.asked)
                        if self.asked is not None else None)
            # A streamed choice's finish_reason is null until its last chunk, which the type (made for
            # whole answers) does not allow: built unvalidated, as the client reads it.
            choice = CompletionChoice.model_construct(index=d.index, text=d.content, finish_reason=d.finish,
                                                      logprobs=logprobs)
            return self._event(Completion.model_construct(
                id=self.request_id, object="text_completion", created=self.created, model=self.model,
                choices=[choice], weight_version=version))
        fields = {"content": d.content} if d.content or not d.tool_call else {}
        if d.tool_call is not None:
            call = d.tool_call
            fields["tool_calls"] = [ChoiceDeltaToolCall(index=0, id=call["id"], type="function", function=call["function"])]
        delta = ChoiceDelta(**fields)
        logprobs = (ChunkLogprobs(content=token_logprobs(d.token_texts, d.logprobs, d.alternatives))
                    if self.asked is not None else None)
        return self._event(ChatCompletionChunk(
            id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model,
            weight_version=version,
            choices=[ChunkChoice(index=d.index, delta=delta, finish_reason=d.finish, logprobs=logprobs)]))

    def usage(self, prompt_tokens: int, completion_tokens: int, version: int) -> str:
        kind = ChatCompletionChunk if self.chat else Completion
        chunk = kind(id=self.request_id, object="chat.completion.chunk" if self.chat else "text_completion",
                     created=self.created, model=self.model, choices=[], usage=usage(prompt_tokens, completion_tokens),
                     weight_version=version)
        return f"data: {json.dumps(as_json(chunk))}\n\n"
