"""The generation-engine interface shared by the embedded torch engine and SGLang.

An engine advances sequences by *windows*: each call generates at most `window_tokens` new tokens
per sequence and returns them with their behaviour log-probs and a finish reason. A sequence cut
at the window is continued by a later call that passes the tokens generated so far.
"""

from __future__ import annotations

from typing import Annotated, Iterable, Protocol

import msgspec
import numpy as np
import torch

from asyncrl.config import SamplingConfig
from asyncrl.config.fields import NonNegativeInt, PositiveFloat
from asyncrl.messages.structs import FinishReason


class SamplingParams(SamplingConfig, frozen=True):
    """One request's sampling: the run's distribution (`SamplingConfig`: temperature, top-p, top-k,
    FIRE, with their ranges), plus greedy decoding and reported alternatives. Built from config or
    from a validated request; `of` takes a run's `sampling` section."""

    temperature: PositiveFloat = 1.0
    """The model's own distribution unless a caller says otherwise (a run's default is its section's)."""
    greedy: bool = False
    """Argmax decoding (evaluation, temperature 0 in the policy endpoint)."""
    top_logprobs: NonNegativeInt = 0
    """Report the this-many most likely tokens at each position with their log-probs under the
    distribution sampled from (OpenAI's top_logprobs); 0 = none. Reporting only: same samples."""
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    """OpenAI's penalty on tokens already in the response (once each); applied to the logits before
    the temperature (`penalised_logits`), so the log-probs reported are the adjusted distribution's.
    The policy endpoint sets it, as it does the two below."""
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    """OpenAI's penalty on tokens already in the response, by how often each occurred."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's per-token logit bias, as (token id, bias) pairs."""
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """vLLM's min-p: only tokens at least this fraction as likely as the most likely one (0 = off).
    A request's setting (the policy endpoint), not a run's: the learners score a run's samples
    under its `sampling` section, which has none."""

    @classmethod
    def of(cls, sampling: SamplingConfig, **request) -> "SamplingParams":
        """A run's `sampling` section as a request's parameters (`request`: greedy, top_logprobs)."""
        return cls(**msgspec.structs.asdict(sampling), **request)

    @property
    def truncation(self) -> tuple[float, int, float, float]:
        """(temperature, top-k, top-p, min-p) as an engine that takes them apart (SGLang) samples:
        greedy is temperature 0 with nothing cut."""
        return (0.0, 0, 1.0, 0.0) if self.greedy else (self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


class SequenceInput(msgspec.Struct, kw_only=True, frozen=True):
    """A sequence to advance: its prompt, what was generated before, and its sampling seed."""

    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R], generated in earlier windows
    seed: int
    max_response_tokens: int  # total response budget; reaching it finishes with MAX_LENGTH
    min_response_tokens: int = 0  # EOS is not sampled before this many response tokens
    # The sequence's identity across windows (the generator's sample id), or None. An engine may
    # keep a keyed sequence's KV cache from one window to its next while its weights do not change.
    key: str | None = None
    # The prompt's processed images by reference (`asyncrl.storage.images`), in the order of its image tokens.
    images: tuple[str, ...] = ()


def long_tail_min_tokens(seed: int, fraction: float, tokens: int) -> int:
    """The long-tail benchmark workload: a `fraction` of samples, chosen by their seed, may not
    end before `tokens` (0 for the others). Deterministic, so a regenerated sample is the same."""
    if fraction <= 0 or tokens <= 0:
        return 0
    draw = np.random.default_rng([seed, 0x7A11]).random()
    return tokens if draw < fraction else 0


class WindowOutput(msgspec.Struct, kw_only=True, frozen=True):
    token_ids: np.ndarray  # int32 [N], N <= window_tokens
    logprobs: np.ndarray  # float32 [N], under the distribution actually sampled from
    finish_reason: FinishReason  # WINDOW means not finished
    # int32 [N]: the weight version of each token, when the engine reports it (SGLang's spans);
    # None: every token is of the engine's version at the window's start (updates land between windows).
    versions: np.ndarray | None = None
    # uint8 [N]: 0 where the token was drawn from a distribution other than the policy's at the run's
    # sampling settings (FIRE's hot first token; EOS held back below a minimum length): the learner
    # does not score those (`Segment.new_scored`). None: every token was.
    scored: np.ndarray | None = None
    # With `SamplingParams.top_logprobs` = k: int32 [N, k] the k most likely tokens at each position,
    # most likely first, and float32 [N, k] their log-probs under the distribution sampled from (-inf:
    # a token top-p/top-k leaves out, which cannot be drawn). None when not asked for.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # [N, sparse_layers, top_k] uint8 or int16 (`asyncrl.messages.routes`): a mixture-of-experts
    # model's experts at the position each token was sampled from (routing replay). None: a dense
    # model, or an engine that does not record them.
    routes: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.WINDOW


def scored_positions(prior: torch.Tensor, min_tokens: torch.Tensor, window_tokens: int,
                     fire: bool | torch.Tensor) -> torch.Tensor | None:
    """uint8 `[B, window]`: 0 at the positions whose distribution was not the policy's at the run's
    settings: FIRE's first response token, and positions where EOS was held back (below a row's
    minimum length). None when every position was. Both engines mark them so (`WindowOutput.scored`).
    `fire`: FIRE on for every row, or per row `[B]`."""
    positions = prior[:, None] + torch.arange(window_tokens)[None, :]
    unscored = positions < min_tokens[:, None]
    if isinstance(fire, torch.Tensor):
        unscored |= (positions == 0) & fire.cpu()[:, None]
    elif fire:
        unscored |= positions == 0
    return None if not bool(unscored.any()) else (~unscored).to(torch.uint8)


class Engine(Protocol):
    """What a generator needs from an inference engine."""

    updates_mid_window: bool
    """True: a weight update is applied as it arrives, while windows run, and each token's version
    comes back in `WindowOutput.versions` (SGLang). False: updates land between windows."""

    @property
    def weight_version(self) -> int:
        """The weight version loaded."""

    async def generate_window(
        self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams
    ) -> list[WindowOutput]: ...

    def stream_window(self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams):
        """As `generate_window`, as an async iterator over decode steps: each a list of
        `(row, token_id, logprob, finish_reason or None, top)` where top is None or, with
        `params.top_logprobs`, `(ids, logprobs)` of that position's most likely tokens (the policy
        endpoint streams tokens as they are produced). Closing it early stops the decoding."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (all or some parameters) and set the version."""

    def adopt_shared(self, shared, version: int) -> None:
        """Take a version from the node's shared memory (`asyncrl.weights.shared_memory.SharedVersion`)."""

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter, version: int) -> None:
        """Take a LoRA version: `<module>.lora_A`, `<module>.lora_B` (`asyncrl.weights.sync.AdapterSpec`
        says the scale), merged into the base weights of those modules, never into an earlier version."""

    def hold_version(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """`policy.weight_delta`: take a whole version and keep it as the weights deltas change."""

    def apply_delta(self, named_tensors: Iterable[tuple[str, torch.Tensor]], base_version: int, version: int) -> None:
        """`policy.weight_delta`: what changed since `base_version` (`asyncrl.weights.delta`); a delta
        from any other version than the one held is refused (`WeightTransferError`)."""
