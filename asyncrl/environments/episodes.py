"""An episode's turn boundaries, the same for every caller (the generators, evaluation, the policy
endpoint): where a policy turn ends in a tool call, what the environment answers, and the tokens
that answer adds to the context.

Token-exact by construction: the policy's tokens are kept as sampled (a turn is cut after the token
that completes the call, never decoded and encoded again); the observation is encoded once, from
the chat template's rendering of the environment's text (`asyncrl.environments.templates`: the
turn's end, the tool turn, the next generation prompt), and appended after them. The prompt lists
the environment's tools through the same template (`asyncrl.data.tasks.encode_prompt`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np
import ray

from asyncrl.environments.formats import FORMATS, Malformed, ToolCall, ToolFormat
from asyncrl.environments.templates import ChatTemplate, PlainText, renderer
from asyncrl.environments.tools import Episode, step_answer

# (call, episode) -> (observation text, error): the environment endpoint (`EnvironmentClient`) or
# an environment in this process (`LocalEnvironment`).
CallEnvironment = Callable[[ToolCall, Episode], Awaitable[tuple[str, bool]]]


@dataclass(frozen=True)
class Observation:
    token_ids: list[int]  # what the context gains: the rendered observation, encoded once
    text: str  # the environment's answer (or what was wrong with the call)
    error: bool  # the call was malformed, failed, or timed out
    malformed: bool


def observation_of(observing: "asyncio.Future") -> Observation:
    """A finished observation task's answer; an environment that raised is an error observation
    (the episode goes on, told what happened)."""
    try:
        return observing.result()
    except Exception as exc:  # noqa: BLE001
        return Observation([], f"error: {type(exc).__name__}", True, False)


class Episodes:
    """A task's episodes: `tool_format` (its stop string, parser and rendering), the environment to
    ask, the tokenizer, and the budget (`max_turns` tool calls; observations cut to
    `max_observation_chars`)."""

    def __init__(self, tool_format: ToolFormat, call_environment: CallEnvironment, tokenizer, max_turns: int,
                 max_observation_chars: int, render: ChatTemplate | PlainText | None = None):
        self.format, self.call_environment, self.tokenizer = tool_format, call_environment, tokenizer
        self.max_turns, self.max_observation_chars = max_turns, max_observation_chars
        # The observation's text: the chat template's tool turn (a model without one: the format's).
        self.render = render if render is not None else PlainText(tool_format)

    def _text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def call_end(self, turn_ids: Sequence[int], new_ids: Sequence[int]) -> int | None:
        """When the turn so far (`turn_ids`, then this window's `new_ids`) ends in a tool call: how
        many of `new_ids` it keeps, up to the token that completes the call. None: no call."""
        turn = list(turn_ids) + list(new_ids)
        if self.format.call_end(self._text(turn)) is None:  # the common case: one decode
            return None
        for k in range(1, len(new_ids) + 1):
            if self.format.call_end(self._text(turn[: len(turn_ids) + k])) is not None:
                return k
        return None  # the call lay wholly in `turn_ids`: one already answered

    async def observe(self, turn_ids: Sequence[int], episode: Episode) -> Observation:
        """The observation of the call that ends `turn_ids` (a policy turn): a malformed call is
        answered with what is wrong with it; a failed one with the failure."""
        call = self.format.parse(self._text(turn_ids))
        if isinstance(call, Malformed):
            text, error, malformed = f"error: {call.reason}", True, True
        else:
            text, error = await self.call_environment(call, episode)
            malformed = False
        text = text[: self.max_observation_chars]
        rendered = self.render.observation(text)
        return Observation(self.tokenizer.encode(rendered, add_special_tokens=False), text, error, malformed)


def build_episodes(environment, tokenizer, call_environment: CallEnvironment, *, use_chat_template: bool,
                   template_kwargs: dict | None = None) -> Episodes | None:
    """The episodes of `environment` (an `EnvironmentConfig`; None when it has none: one turn), their
    observations rendered by the model's chat template where it uses one, with `template_kwargs`
    (`task.chat_template_kwargs`) as the prompts are."""
    if not environment.enabled:
        return None
    fmt = FORMATS[environment.tool_format]()
    return Episodes(fmt, call_environment, tokenizer, environment.max_turns, environment.max_observation_chars,
                    renderer(tokenizer, fmt, use_chat_template, template_kwargs))


class EnvironmentClient:
    """The environment endpoint as a generator calls it: with a timeout and retries; a call that
    still fails is answered with an error observation, never a lost or hung episode."""

    def __init__(self, endpoint, timeout_s: float, retries: int):
        self.endpoint, self.timeout_s, self.retries = endpoint, timeout_s, retries
        self.failures = 0

    async def __call__(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        error = ""
        for _ in range(self.retries + 1):
            try:
                return await asyncio.wait_for(
                    self.endpoint.step.remote(call.name, call.arguments, episode.prompt_id, episode.sample_idx),
                    self.timeout_s)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
                error = type(exc).__name__
        self.failures += 1
        return f"error: the tool did not answer ({error} after {self.retries + 1} tries)", True


class LocalEnvironment:
    """An environment in this process (evaluation, the policy endpoint's own tests)."""

    def __init__(self, environment):
        self.environment = environment

    async def __call__(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        return await asyncio.to_thread(step_answer, self.environment, call, episode)


@dataclass
class _Run:
    """One episode being completed: its response so far and which tokens were observations."""

    prompt: list[int]
    seed: int
    episode: Episode
    response: list[int]
    logprobs: list[float]
    observation: list[int]
    turn_start: int = 0
    tool_calls: int = 0
    finish_reason: object = None


def complete_episodes(engine, tokenizer, episodes: Episodes, prompts: list[list[int]], seeds: list[int],
                      identities: list[Episode], max_tokens: int, params, batch_size: int = 16, on_batch=None):
    """Whole episodes (evaluation, the policy endpoint): each turn generated to its end (a tool
    call, EOS, the budget), the observation appended, the next turn, up to `episodes.max_turns`
    calls. The completions' text is the final turn's (what a verifier reads), their tokens every
    turn's. The same turn boundaries as the generators' (`Episodes.call_end` / `observe`)."""
    from asyncrl.engines.generation import Completion, decode, sequence_input
    from asyncrl.messages.structs import FinishReason, final_turn_start

    runs = [_Run(list(p), s, e, [], [], []) for p, s, e in zip(prompts, seeds, identities)]
    for start in range(0, len(runs), batch_size):
        batch = runs[start: start + batch_size]
        while active := [r for r in batch if r.finish_reason is None]:
            outputs = engine.generate_window_sync(
                [sequence_input(r.prompt, r.seed, max_tokens, r.response) for r in active], max_tokens, params)
            calls = []
            for run, out in zip(active, outputs):
                called = episodes.call_end(run.response[run.turn_start:], out.token_ids)
                keep = len(out.token_ids) if called is None else called
                run.response += out.token_ids[:keep].tolist()
                run.logprobs += out.logprobs[:keep].tolist()
                run.observation += [0] * keep
                if called is None:
                    run.finish_reason = out.finish_reason
                elif run.tool_calls >= episodes.max_turns:
                    run.finish_reason = FinishReason.MAX_TURNS
                else:
                    calls.append(run)
            observations = asyncio.run(_observe_all(episodes, calls)) if calls else []
            for run, observation in zip(calls, observations):
                run.tool_calls += 1
                if len(run.response) + len(observation.token_ids) >= max_tokens:
                    run.finish_reason = FinishReason.MAX_LENGTH  # no room for the answer
                    continue
                run.response += observation.token_ids
                run.logprobs += [0.0] * len(observation.token_ids)
                run.observation += [1] * len(observation.token_ids)
                run.turn_start = len(run.response)
        if on_batch is not None:
            on_batch(len(batch))
    return [Completion(np.asarray(r.response, dtype=np.int32), np.asarray(r.logprobs, dtype=np.float32),
                       r.finish_reason, decode(tokenizer, r.response[final_turn_start(r.observation):])) for r in runs]


async def _observe_all(episodes: Episodes, runs: list[_Run]) -> list[Observation]:
    return await asyncio.gather(*(episodes.observe(r.response[r.turn_start:], r.episode) for r in runs))
