"""Messages that cross actor boundaries.

Every message is a `msgspec.Struct` encoded as msgpack. Numeric arrays (token ids, log-probs,
weight versions, per-token rewards) are numpy arrays carried as msgpack extension values holding
raw little-endian bytes, never as lists of Python numbers; images as references, never pixels.

Invariants checked on construction *and* on decode (msgspec runs `__post_init__` when decoding):
array dtypes and the lengths that must agree. A malformed message raises `msgspec.ValidationError`
whose text names the offending field.

Wire evolution: structs are encoded as maps (field names on the wire), so a decode error names the
field and new fields may be appended with defaults; never change a field's type."""

from __future__ import annotations

import enum
import json
from typing import Any

import msgspec
import numpy as np

# The wire format lives in `asyncrl.messages.wire`; the names every role uses with it are here too.
from asyncrl.messages.routes import check_routes, joined_routes
from asyncrl.messages.wire import Codec, check_array, encode, float32_array, int32_array  # noqa: F401

# --- messages ---------------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    """Why a segment ended. `WINDOW` and `TOOL_CALL` mean *not* finished: cut at the window, or at a
    tool call whose observation follows (an episode); the sample continues next turn."""

    EOS = "eos"
    MAX_LENGTH = "max_length"
    MAX_TURNS = "max_turns"  # an episode's tool call beyond `environment.max_turns`: it ends there
    WINDOW = "window"
    TOOL_CALL = "tool_call"

    @property
    def continues(self) -> bool:
        return self in (FinishReason.WINDOW, FinishReason.TOOL_CALL)


class SampleState(str, enum.Enum):
    """Where a sample is in the ledger (`asyncrl.storage.ledger`); a state only moves forward, in this order."""

    IN_FLIGHT = "in_flight"
    AWAITING_REWARD = "awaiting_reward"
    AWAITING_TRAINING = "awaiting_training"
    TRAINED = "trained"
    DROPPED = "dropped"
    RECORDED = "recorded"  # mode=generate: scored and stored, never trained


class DropReason(str, enum.Enum):
    """Why a sample (or a T-PPO window row) ended without being trained."""

    NO_SIGNAL = "no_signal"  # dynamic sampling: every member of the group scored alike
    REWARD_FAILED = "reward_failed"  # the reward endpoint gave no score (timeout, error, no verdict)
    STALE = "stale"  # every token too many versions behind the weights being trained
    VALUE_WARMUP = "value_warmup"  # the critic was still in its pretraining
    ROUTES_MISFIT = "routes_misfit"  # its experts were recorded for another model (routing replay)


class PromptRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One prompt to be sampled `group_size` times by the generators."""

    prompt_id: str
    prompt_token_ids: np.ndarray  # int32 [P]
    group_size: int
    data_source: str = ""
    # The answer the reward checks against: a string, or what the data holds (a dict of tests, a list).
    ground_truth: Any = ""
    prompt_text: str = ""
    # The prompt's row of the data as read (its columns: `extra_info`, the prompt as written, ...),
    # for a reward function of the user's (verl's `extra_info`, TRL's columns); None for built-in tasks.
    row: dict[str, Any] | None = None
    # Sampling seed of the prompt; sample i uses seed + i, so results do not depend on batching.
    seed: int = 0
    # Which of the G samples to generate (empty = all): a resumed run regenerates only the samples
    # of a prompt whose work was lost with the old actors.
    sample_indices: tuple[int, ...] = ()
    images: tuple[str, ...] = ()  # processed images by reference (`asyncrl.storage.images`), never pixels

    def __post_init__(self) -> None:
        check_array("prompt_token_ids", self.prompt_token_ids, "int32")
        if self.prompt_token_ids.shape[0] == 0:
            raise ValueError("field `prompt_token_ids`: a prompt needs at least one token")
        if self.group_size < 1:
            raise ValueError(f"field `group_size`: must be >= 1, got {self.group_size}")
        if len(set(self.sample_indices)) != len(self.sample_indices) or not all(
                0 <= i < self.group_size for i in self.sample_indices):
            raise ValueError(f"field `sample_indices`: distinct indices in [0, {self.group_size}) expected")

    @property
    def samples(self) -> tuple[int, ...]:
        return self.sample_indices or tuple(range(self.group_size))

    @property
    def msg_id(self) -> str:
        return self.prompt_id


class Segment(msgspec.Struct, kw_only=True, frozen=True):
    """A partial trajectory: one generator window of one sample of one prompt.

    Identity is `(prompt_id, sample_idx, window)`; the G samples of a prompt share `group_id`.
    `prior_response_ids` are the response tokens generated in earlier windows (context for this
    one, "response tokens so far"); `new_token_ids` are this window's tokens, with their behaviour
    log-probs under the sampling distribution actually used and the weight version of each token.
    (A tool turn of an episode is another thing: it spans windows, see `new_observation`.)
    """

    prompt_id: str
    sample_idx: int
    # The window's index from 0. Named `turn` on the wire, as stored trajectories and the golden
    # batches recorded it.
    window: int = msgspec.field(name="turn")
    group_id: str
    prompt_token_ids: np.ndarray  # int32 [P]
    prior_response_ids: np.ndarray  # int32 [R]
    prior_versions: np.ndarray  # int32 [R]
    new_token_ids: np.ndarray  # int32 [N]
    new_logprobs: np.ndarray  # float32 [N]
    new_versions: np.ndarray  # int32 [N]
    finished: bool
    finish_reason: FinishReason
    data_source: str = ""
    ground_truth: Any = ""
    seed: int = 0
    generator_id: str = ""
    group_size: int = 1  # G: samples in this segment's group (the assembler waits for all G)
    # uint8 [N], set by the engine: 0 where a token was drawn from a distribution the learner does not
    # score (FIRE's hot first token; a position where EOS was held back by a minimum length), so it
    # carries no policy loss and no KL. None: every token was drawn from the policy's distribution.
    new_scored: np.ndarray | None = None
    # uint8 [N]: 1 where the token is an environment's observation (an episode's tool result, in the
    # context, never trained: its `new_scored` is 0, its log-prob 0). None: no observation.
    new_observation: np.ndarray | None = None
    # uint8 [R]: `new_observation` of the earlier windows' tokens (None: no observation among them),
    # so a row holding the whole response (T-PPO's last window) never trains an observation.
    prior_observation: np.ndarray | None = None
    # The prompt's data row (`PromptRequest.row`), on a sample's finished segment only (or None).
    row: dict[str, Any] | None = None
    # [N, sparse_layers, top_k] uint8 or int16 (`asyncrl.messages.routes`): the experts a
    # mixture-of-experts model used for each new token, as the engine recorded them (routing replay).
    # None: a dense model, or an engine that does not record them.
    new_routes: np.ndarray | None = None
    # [R, sparse_layers, top_k]: the routes of the earlier windows' tokens (a window row's context),
    # filled in by the assembler; None when not held.
    prior_routes: np.ndarray | None = None
    images: tuple[str, ...] = ()  # the prompt's images, as `PromptRequest.images`: references

    def __post_init__(self) -> None:
        check_array("prompt_token_ids", self.prompt_token_ids, "int32")
        check_array("prior_response_ids", self.prior_response_ids, "int32")
        check_array("prior_versions", self.prior_versions, "int32", len(self.prior_response_ids))
        check_array("new_token_ids", self.new_token_ids, "int32")
        n = len(self.new_token_ids)
        check_array("new_logprobs", self.new_logprobs, "float32", n)
        check_array("new_versions", self.new_versions, "int32", n)
        if self.new_scored is not None:
            check_array("new_scored", self.new_scored, "uint8", n)
        if self.new_observation is not None:
            check_array("new_observation", self.new_observation, "uint8", n)
            if self.new_scored is None or (self.new_scored[self.new_observation.astype(bool)] != 0).any():
                raise ValueError("field `new_scored` must be 0 where `new_observation` is 1 (observations are not trained)")
        if self.prior_observation is not None:
            check_array("prior_observation", self.prior_observation, "uint8", len(self.prior_response_ids))
        if self.new_routes is not None:
            check_routes("new_routes", self.new_routes, n)
        if self.prior_routes is not None:
            check_routes("prior_routes", self.prior_routes, len(self.prior_response_ids))
            new, prior = self.new_routes, self.prior_routes
            if new is not None and (new.shape[1:] != prior.shape[1:] or new.dtype != prior.dtype):
                raise ValueError("fields `prior_routes` and `new_routes` differ in shape or dtype (one model's routes)")
        if self.finished == self.finish_reason.continues:
            raise ValueError(
                f"field `finish_reason`: {self.finish_reason.value!r} contradicts finished={self.finished}"
            )
        if self.sample_idx < 0 or self.window < 0:
            raise ValueError("fields `sample_idx` and `turn` (the window) must be >= 0")
        if not 0 <= self.sample_idx < self.group_size:
            raise ValueError(f"field `sample_idx`: {self.sample_idx} outside group of size {self.group_size}")

    @property
    def msg_id(self) -> str:
        """Unique per window of one generator's copy of the sample: a producer's retry is dropped
        as a duplicate, while two generators' copies (a prompt whose lease ran out, one handed over
        by a generator that left) both reach the assembler, which keeps one."""
        return f"{segment_id(self.prompt_id, self.sample_idx, self.window)}@{self.generator_id}"

    @property
    def sample_id(self) -> str:
        return sample_id(self.prompt_id, self.sample_idx)

    @property
    def response_ids(self) -> np.ndarray:
        """All response tokens so far, this turn's included."""
        return np.concatenate([self.prior_response_ids, self.new_token_ids])

    @property
    def response_versions(self) -> np.ndarray:
        return np.concatenate([self.prior_versions, self.new_versions])


def observation_mask(segment: Segment) -> np.ndarray:
    """bool [N]: the new tokens that are an environment's observation."""
    if segment.new_observation is None:
        return np.zeros(len(segment.new_token_ids), dtype=bool)
    return segment.new_observation.astype(bool)


def final_turn_start(observation) -> int:
    """Where the policy's last turn starts in a response whose observation mask is `observation`
    (per token, 1 = the environment's; None = no observation): after the last observation. What a
    verifier reads of an episode."""
    observed = np.flatnonzero(np.asarray(observation if observation is not None else [], dtype=np.uint8))
    return int(observed[-1]) + 1 if len(observed) else 0


def scored_mask(segment: Segment) -> np.ndarray:
    """float32 [N]: 1 where the learner scores the token's behaviour distribution (see `new_scored`)."""
    if segment.new_scored is None:
        return np.ones(len(segment.new_token_ids), dtype=np.float32)
    return segment.new_scored.astype(np.float32)


def segment_row(segment: Segment) -> tuple[np.ndarray, np.ndarray]:
    """A segment as a training row: its context (prompt + earlier windows, no gradient) and its new
    tokens. The learner, the value learner and the assembler's value requests all read rows so."""
    return np.concatenate([segment.prompt_token_ids, segment.prior_response_ids]), segment.new_token_ids


def routed_row(segment: Segment) -> tuple[np.ndarray, ...]:
    """`segment_row`, and the routes of its response tokens (`response_routes`) where it has any: a
    row another learner's forward (values, the reference's log-probs) replays as the policy's does.
    A dense model's rows stay pairs."""
    routes = response_routes(segment)
    return segment_row(segment) if routes is None else (*segment_row(segment), routes)


def response_routes(segment: Segment) -> np.ndarray | None:
    """The routes of every response token of a segment (earlier windows', then this one's), those
    not held `UNROUTED`; None when it holds none. They cover the row's last tokens: its prompt's
    positions are routed by the learner."""
    return joined_routes([(segment.prior_routes, len(segment.prior_response_ids)),
                          (segment.new_routes, len(segment.new_token_ids))])


def has_ground_truth(ground_truth: Any) -> bool:
    """The data gave an answer to check against (0 and an empty list are answers; None and "" are not)."""
    return ground_truth is not None and ground_truth != ""


def ground_truth_text(ground_truth: Any) -> str:
    """A ground truth as text (the built-in verifiers and judges, the trajectory store): a string as
    it is, a number as written, anything else (a dict of tests, a list) as JSON."""
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    return "" if ground_truth is None else json.dumps(ground_truth, sort_keys=True, default=str)


def sample_id(prompt_id: str, sample_idx: int) -> str:
    return f"{prompt_id}/{sample_idx}"


def segment_id(prompt_id: str, sample_idx: int, turn: int) -> str:
    return f"{prompt_id}/{sample_idx}/{turn}"


class RewardRequest(msgspec.Struct, kw_only=True, frozen=True):
    """What a reward endpoint is asked to score: one finished response."""

    prompt_id: str
    sample_idx: int
    response_text: str
    ground_truth: Any
    data_source: str
    prompt_text: str = ""
    # Policy token ids of the response: process reward models score per token on them.
    response_token_ids: np.ndarray | None = None
    # The prompt's data row (`PromptRequest.row`): a reward function's `extra_info` and columns.
    row: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.response_token_ids is not None:
            check_array("response_token_ids", self.response_token_ids, "int32")

    @property
    def msg_id(self) -> str:
        return sample_id(self.prompt_id, self.sample_idx)


class PairRequest(msgspec.Struct, kw_only=True, frozen=True):
    """A pairwise judgement: is `first` better than `second` for this prompt?"""

    prompt_text: str
    first: str
    second: str
    ground_truth: str = ""  # the reference text a generative judge is shown ("" = none)
    data_source: str = ""  # a verifier judge checks both with this source's rule against `truth`
    truth: Any = None  # the prompt's ground truth as the data holds it (a dict of tests, a list); None: none
    second_is_reference: bool = False  # anchor=reference: `second` is the ground truth written as a response


class Reward(msgspec.Struct, kw_only=True, frozen=True):
    """The reward of one finished sample, from one reward endpoint.

    `score` is the sequence-level reward placed on the last token; `token_rewards`, when present,
    are dense per-response-token rewards (process rewards) added on top.
    """

    prompt_id: str
    sample_idx: int
    score: float
    source: str
    source_version: str = ""
    token_rewards: np.ndarray | None = None  # float32 [response length]
    correct: bool | None = None
    failed: bool = False
    details: dict[str, Any] = {}
    suspicious: list[str] = []
    """Reward-hacking conduct the endpoint saw (code: early_exit, exit_during_test, fake_value,
    forged_report; judge: addresses_judge). The reward already ignores it; the metrics count it."""

    def __post_init__(self) -> None:
        if self.token_rewards is not None:
            check_array("token_rewards", self.token_rewards, "float32")
        if not np.isfinite(self.score):
            raise ValueError(f"field `score`: must be finite, got {self.score}")

    @property
    def msg_id(self) -> str:
        return sample_id(self.prompt_id, self.sample_idx)


class TrainingRow(msgspec.Struct, kw_only=True, frozen=True):
    """One row of a training batch: a segment, its reward and its advantages (one per new token)."""

    segment: Segment
    score: float
    advantages: np.ndarray  # float32 [len(segment.new_token_ids)]
    correct: bool | None = None
    # uint8 [len(new_token_ids)]: 0 excludes a token from the policy loss (T-PPO's window-edge
    # tokens of unfinished rows). None trains every new token.
    loss_mask: np.ndarray | None = None
    # Weight version of the value model whose values built `advantages` (value-based algorithms).
    value_version: int | None = None

    def __post_init__(self) -> None:
        n = len(self.segment.new_token_ids)
        check_array("advantages", self.advantages, "float32", n)
        if self.loss_mask is not None:
            check_array("loss_mask", self.loss_mask, "uint8", n)


class ScoredTrajectory(msgspec.Struct, kw_only=True, frozen=True):
    """A finished response (all windows merged) and its reward: what the value learner trains on,
    with Monte-Carlo targets built from `score` on the last token plus any dense `token_rewards`."""

    segment: Segment
    score: float
    token_rewards: np.ndarray | None = None  # float32, aligned with segment.new_token_ids
    correct: bool | None = None
    # float32 [len(new_token_ids)]: V(s_t) as recorded when the response's rows were valued for
    # their advantages: the anchor of the clipped value loss (None: clip around the pre-step values).
    values: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.segment.finished:
            raise ValueError(f"ScoredTrajectory {self.segment.sample_id}: segment is not finished")
        if self.token_rewards is not None:
            check_array("token_rewards", self.token_rewards, "float32")
        if self.values is not None:
            check_array("values", self.values, "float32", len(self.segment.new_token_ids))

    @property
    def msg_id(self) -> str:
        return self.segment.sample_id


class TrainBatch(msgspec.Struct, kw_only=True, frozen=True):
    """A training batch for a learner. `batch_id` is unique, so a batch is trained at most once."""

    batch_id: str
    rows: list[TrainingRow] = msgspec.field(name="samples")  # its name in saved batches before it was `rows`
    # Metrics of the assembly that produced this batch (dropped groups, staleness, ...).
    stats: dict[str, float] = {}
    # Why a batch has no rows: the learner skips the step and records this (bounded refill).
    skip_reason: str = ""

    @property
    def msg_id(self) -> str:
        return self.batch_id


