"""A generator's sequences: what each has generated so far, and its windows as `Segment`s.

A sequence is one sample of a prompt (`sample_idx` of its G) advancing window by window; each
window becomes a segment carrying the window's tokens with their log-probs, versions and routes,
and what came before (the context a learner row needs). An episode's tool result is spliced into
the segment that ended in the call (`with_observation`): in the context, never trained.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import numpy as np

from asyncrl.messages.routes import joined_routes
from asyncrl.messages.structs import FinishReason, PromptRequest, Segment, observation_mask, scored_mask


@dataclass
class GeneratedSequence:
    request: PromptRequest
    sample_idx: int
    window: int = 0  # windows this sequence has advanced (its segments' `window`)
    response_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    min_response_tokens: int = 0  # drawn once at admission (long-tail workload), not per window
    observation: list[int] = field(default_factory=list)  # per response token: 1 = environment's (episodes)
    turn_start: int = 0  # where the policy's current turn starts in `response_ids` (episodes)
    tool_calls: int = 0

    def extend(self, segment: Segment, episodes: bool) -> None:
        """The context grows by a segment that continues (`episodes`: observations are tracked)."""
        self.response_ids += segment.new_token_ids.tolist()
        self.versions += segment.new_versions.tolist()
        if episodes:
            self.observation += observation_mask(segment).astype(np.uint8).tolist()
        self.window += 1


@dataclass
class ParkedEpisode:
    """An episode waiting for its tool call's observation, with the segment that ends in the call."""

    sequence: GeneratedSequence
    segment: Segment
    observing: asyncio.Task


def window_segment(seq: GeneratedSequence, generator_id: str, tokens, logprobs, versions, scored, routes,
                   finished: bool, reason: FinishReason) -> Segment:
    """One window of `seq` as the segment the generator sends (per-token arrays: `scored` and
    `routes` may be None)."""
    request = seq.request
    return Segment(
        prompt_id=request.prompt_id, sample_idx=seq.sample_idx, window=seq.window, group_id=request.prompt_id,
        prompt_token_ids=request.prompt_token_ids,
        prior_response_ids=np.asarray(seq.response_ids, dtype=np.int32),
        prior_versions=np.asarray(seq.versions, dtype=np.int32),
        prior_observation=np.asarray(seq.observation, dtype=np.uint8) if seq.tool_calls else None,
        new_token_ids=tokens, new_logprobs=logprobs, new_versions=versions, new_scored=scored, new_routes=routes,
        finished=finished, finish_reason=reason, data_source=request.data_source,
        ground_truth=request.ground_truth, seed=request.seed + seq.sample_idx, generator_id=generator_id,
        group_size=request.group_size, row=request.row if finished else None, images=request.images)


def with_observation(segment: Segment, observation_ids, engine_version: int) -> Segment:
    """`segment` (ending in a tool call) followed by the observation's tokens: log-prob 0, unscored,
    marked as an observation, at the version of the call's last token (the engine's when the
    segment has none), no route (the learner routes observations itself)."""
    n, k = len(segment.new_token_ids), len(observation_ids)
    last_version = int(segment.new_versions[-1]) if n else engine_version
    return msgspec.structs.replace(
        segment, new_token_ids=np.concatenate([segment.new_token_ids, np.asarray(observation_ids, dtype=np.int32)]),
        new_logprobs=np.concatenate([segment.new_logprobs, np.zeros(k, dtype=np.float32)]),
        new_versions=np.concatenate([segment.new_versions, np.full(k, last_version, dtype=np.int32)]),
        new_scored=np.concatenate([scored_mask(segment).astype(np.uint8), np.zeros(k, dtype=np.uint8)]),
        new_observation=np.concatenate([np.zeros(n, dtype=np.uint8), np.ones(k, dtype=np.uint8)]),
        new_routes=joined_routes([(segment.new_routes, n), (None, k)]))
