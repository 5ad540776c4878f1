"""One request to the policy endpoint, from its prompt tokens to its answer or stream: the checks
that need the prompt (length, KV bound, tools), the engine's sequences, and the choices read off
the engine's steps. Everything heavier than a dictionary update (tokenising, detokenising, stop and
call search, building the answer) runs in a worker thread, a batch of steps at a time, so the
event loop keeps serving every other request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import jinja2

from asyncrl.api.choices import ChoiceText, Delta
from asyncrl.api.requests import (OpenAIError, check_model_name, choice_seeds, logprobs_asked, response_tokens,
                                  sampling_of, stops_of)
from asyncrl.api.responses import Answer, Chunks
from asyncrl.engines.batch_jobs import TooLarge
from asyncrl.engines.generation import sequence_input


def chat_prompt(server, body) -> tuple[list[int], str, tuple[str, ...]]:
    """A chat request's prompt tokens (the conversation in pieces, as an episode's, its images'
    tokens expanded), the text written for the model before it samples (the start of a required
    call) and its processed images (`asyncrl.api.images`); in a worker thread."""
    from asyncrl.environments.templates import encode
    from asyncrl.api.tools import ToolsError, check_tools, conversation_ids, forced_start

    try:
        check_tools(body)
    except ToolsError as exc:
        raise OpenAIError(400, str(exc), exc.param) from exc
    body, images = server.images.read(body)  # image parts: stored, processed, written as the model's tokens
    try:
        ids = conversation_ids(body, server.render, server.tokenizer)
    except jinja2.TemplateError as exc:  # the model's own template refuses the conversation (a role it has not)
        raise OpenAIError(400, f"the model's chat template cannot render these messages: {exc}", "messages") from exc
    ids = server.images.expand(ids, images, server.tokenizer)
    start = forced_start(body, server.format) if body.tools else ""
    return ids + (encode(server.tokenizer, start) if start else []), start, images


@dataclass
class Prepared:
    """A request checked against its prompt: its engine sequences and sampling, and its choices."""

    body: object
    chat: bool
    prompt_ids: list[list[int]]
    asked: int | None
    choices: list[ChoiceText]
    sequences: list
    params: object
    start_tokens: int = 0  # the start of a required call, written for the model: its answer's, not the prompt's

    @classmethod
    def of(cls, server, body, prompt_ids: list[list[int]], chat: bool, start: str = "",
           images: list[tuple[str, ...]] | None = None) -> "Prepared":
        """`images`: each prompt's processed images (None: none); its `n` choices share them."""
        from asyncrl.api.tools import CallReader, offered

        check_model_name(body.model, server.config.model.name)
        asked = logprobs_asked(body, chat)
        max_tokens = response_tokens(body, prompt_ids, server.policy.context_tokens,
                                     server.config.serve.max_response_tokens, chat)
        params = sampling_of(body, asked or 0, server.policy.vocab_size)
        seeds = choice_seeds(body, len(prompt_ids))
        prompts = [ids for ids in prompt_ids for _ in range(body.n)]
        shown = [refs for refs in (images or [()] * len(prompt_ids)) for _ in range(body.n)]
        reader = CallReader(server.format, offered(body)) if chat and offered(body) else None
        start_tokens = len(server.tokenizer.encode(start, add_special_tokens=False)) if start else 0
        choices = [ChoiceText(i, server.tokenizer, stops_of(body), reader, start, start_tokens, alternatives=bool(asked))
                   for i in range(len(prompts))]
        sequences = [sequence_input(ids, seed, max_tokens, images=refs)
                     for ids, seed, refs in zip(prompts, seeds, shown)]
        return cls(body, chat, prompt_ids, asked, choices, sequences, params, start_tokens)

    def start(self, policy):
        """The request's steps from the engine; refused (400) when it can never fit its bounds."""
        try:
            return policy.stream(self.sequences, self.params, live=bool(self.body.stream))
        except TooLarge as exc:
            raise OpenAIError(400, f"request too large: {exc}", "max_tokens") from exc

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) - self.start_tokens for ids in self.prompt_ids)  # each prompt once, however many choices


def _feed(choices: list[ChoiceText], batch) -> list[Delta]:
    """A delta per token, in the order sampled (a stream sends each token as its own chunk)."""
    return [choices[step.row].feed([step]) for step in batch if not choices[step.row].done]


async def deltas(prepared: Prepared, steps):
    """The choices' deltas as the engine samples (a list per batch of steps, read in a worker
    thread); rows whose choice ended (a stop string, a call) are dropped from the engine. Closing
    this (the client gone) frees the request's sequences."""
    try:
        done = [c.index for c in prepared.choices if c.done]  # a call the forced start completed
        if done:
            steps.drop(done)
            yield [Delta(c.index, c.content or "", tool_call=c.tool_call, finish=c.finish) for c in prepared.choices
                   if c.done]
        if all(c.done for c in prepared.choices):
            return
        async for batch in steps:
            out = await asyncio.to_thread(_feed, prepared.choices, batch)
            ended = [d.index for d in out if d.finish]
            if ended:
                steps.drop(ended)
            yield out
            if all(c.done for c in prepared.choices):
                return
        # The engine ended a row without a reason (SGLang: a weight update cut it at its last token).
        yield [c.end("length") for c in prepared.choices if not c.done]
    finally:
        steps.close()


async def answer(prepared: Prepared, steps, request_id: str, model: str, version: int) -> dict:
    """A whole answer (chat or completion) with its usage and the version of its first token
    (`version`, the engine's at the start, when it sampled none)."""
    gathered = Answer(len(prepared.choices))
    versions = []
    async for out in deltas(prepared, steps):
        for d in out:
            gathered.add(d)
            versions += [d.version] if d.version is not None else []
    version = versions[0] if versions else version
    build = gathered.chat if prepared.chat else gathered.completion
    payload = await asyncio.to_thread(build, request_id, model, prepared.choices, prepared.prompt_tokens, version,
                                      prepared.asked)
    if len(set(versions)) > 1:  # updates land between windows: a long answer may span versions
        payload["weight_versions"] = sorted(set(versions))
    return payload


async def events(prepared: Prepared, steps, request_id: str, model: str, version: int):
    """The server-sent events of a streamed request (`asyncrl.api.responses.Chunks`)."""
    body = prepared.body
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = Chunks(request_id, model, prepared.chat, prepared.asked, include_usage)
    if prepared.chat:
        for choice in prepared.choices:
            yield chunks.role(choice.index, version)
    async for out in deltas(prepared, steps):
        pieces = await asyncio.to_thread(lambda: [chunks.delta(d, d.version if d.version is not None else version)
                                                  for d in out])
        for piece in pieces:
            if piece is not None:
                yield piece
    if include_usage:
        yield chunks.usage(prepared.prompt_tokens, sum(c.completion_tokens for c in prepared.choices), version)
    yield "data: [DONE]\n\n"
