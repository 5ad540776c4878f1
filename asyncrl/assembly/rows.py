"""Training rows from segments and outcomes (pure functions): merging a sample's windows, dense
reward credit, (E)GAE rows, whole-response rows for the positive-example NLL, whitening, and where a
value-based batch ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from asyncrl.algo.advantages import masked_whiten
from asyncrl.algo.shaping import is_positive, kl_reward
from asyncrl.config import GAEAdvantage, KLPenalty
from asyncrl.messages.routes import joined_routes
from asyncrl.messages.structs import Segment, TrainingRow, observation_mask, response_routes, scored_mask


@dataclass(frozen=True)
class Outcome:
    """The reward of a finished response as the strategies and the critic see it."""

    score: float  # the endpoint's score plus the overlong penalty: shaped once, by the assembler
    correct: bool | None = None
    token_rewards: np.ndarray | None = None  # aligned with the *whole* response
    failed: bool = False  # the reward endpoint gave no score (timeout, error): the row is dropped


def kl_rewards(segment: Segment, reference_logp: np.ndarray, kl: KLPenalty) -> np.ndarray:
    """`−β·KL_t` for each new token of a row, from its behaviour log-probs and the reference's (0
    where the behaviour distribution was not the policy's: the tokens the engine marked unscored)."""
    out = kl_reward(torch.from_numpy(segment.new_logprobs.astype(np.float64)),
                    torch.from_numpy(np.asarray(reference_logp, dtype=np.float64)), kl.coef, kl.estimator)
    return (out.numpy() * scored_mask(segment)).astype(np.float32)


def merge_segments(segments: list[Segment]) -> Segment:
    """All windows of one sample as a single row: the whole response becomes the new tokens."""
    segments = sorted(segments, key=lambda s: s.window)
    windows = [s.window for s in segments]
    if windows != list(range(len(segments))):
        raise ValueError(f"sample {segments[0].sample_id} has windows {windows}, expected 0..{len(segments) - 1}")
    last = segments[-1]
    if not last.finished:
        raise ValueError(f"sample {last.sample_id} is not finished")
    empty = np.zeros(0, dtype=np.int32)
    return Segment(
        prompt_id=last.prompt_id,
        sample_idx=last.sample_idx,
        window=last.window,
        group_id=last.group_id,
        prompt_token_ids=last.prompt_token_ids,
        prior_response_ids=empty,
        prior_versions=empty,
        new_token_ids=np.concatenate([s.new_token_ids for s in segments]),
        new_logprobs=np.concatenate([s.new_logprobs for s in segments]),
        new_versions=np.concatenate([s.new_versions for s in segments]),
        new_scored=None if all(s.new_scored is None for s in segments) else np.concatenate(
            [scored_mask(s).astype(np.uint8) for s in segments]),
        new_observation=None if all(s.new_observation is None for s in segments) else np.concatenate(
            [observation_mask(s).astype(np.uint8) for s in segments]),
        # Each window's routes as recorded, under the weights of its own tokens.
        new_routes=joined_routes([(s.new_routes, len(s.new_token_ids)) for s in segments]),
        finished=True,
        finish_reason=last.finish_reason,
        data_source=last.data_source,
        ground_truth=last.ground_truth,
        row=last.row,
        seed=last.seed,
        generator_id=last.generator_id,
        group_size=last.group_size,
        images=last.images,
    )


def reward_to_go(token_rewards: np.ndarray, length: int) -> np.ndarray:
    """Suffix sums of per-token rewards, aligned to the response start and cut or zero-padded to
    `length`: an endpoint returning the wrong number of token rewards must not crash the assembler."""
    aligned = np.zeros(length, dtype=np.float32)
    n = min(length, len(token_rewards))
    aligned[:n] = token_rewards[:n]
    return np.cumsum(aligned[::-1])[::-1].astype(np.float32)


def undiscounted_rewards(returns: np.ndarray) -> np.ndarray:
    """The token rewards behind undiscounted returns `G_t = Σ_{t'>=t} r_t'` (`reward_to_go`'s
    inverse): `r_t = G_t − G_{t+1}`, the last token's reward its return."""
    returns = np.asarray(returns, dtype=np.float64)
    return returns - np.append(returns[1:], 0.0)


def cut_row_batch(rows: list[TrainingRow], finished_per_batch: int) -> int | None:
    """Where a value-based batch ends: just after its N-th finished row, taking every window that
    arrived before it (so each step consumes N samples, like the group mode, and the prompt
    source's admission budget matches consumption). None while fewer than N rows are finished."""
    seen = 0
    for i, row in enumerate(rows):
        seen += row.segment.finished
        if seen == finished_per_batch:
            return i + 1
    return None


def value_rows(rows: list[Segment], values: list[np.ndarray], outcomes: list[Outcome | None],
               gae: GAEAdvantage, window_tokens: int, value_version: int | None = None,
               token_rewards_extra: list[np.ndarray] | None = None, advantage_fn=None) -> list[TrainingRow]:
    """Policy rows with (E)GAE advantages. `values[i]` holds `V(s_t)` for each of row i's n new
    tokens plus `V(s_n)`, the state after its last token (`predict_values(..., with_next=True)`).
    `token_rewards_extra[i]` (n per row) are added to every row's token rewards (the KL penalty).

    A finished row (the last window, or a whole response) carries its outcome (already shaped) on
    the last token and is plain GAE; an unfinished window (T-PPO) bootstraps with its last value,
    and its last `edge_mask_tokens` tokens are left out of the loss. λ is fixed or length-adaptive
    per row. `advantage_fn`: the advantage's function (`ADVANTAGES["gae"].fn`, EGAE by default).
    Unwhitened; see `whiten_rows`.
    """
    from asyncrl.algo.advantages import egae, length_adaptive_lambda, tppo_lambda_lengths

    advantage_fn = advantage_fn or egae

    if not rows:
        return []
    token_rewards, value_t, mask, next_values, shaped_scores = _value_tensors(rows, values, outcomes,
                                                                              token_rewards_extra)
    finished = torch.tensor([r.finished for r in rows])
    generated = torch.tensor([len(r.prior_response_ids) + len(r.new_token_ids) for r in rows])
    if gae.length_adaptive_alpha > 0:
        lengths = (tppo_lambda_lengths(generated, finished, window_tokens) if gae.window_training
                   else generated.to(torch.float64))
        lam = length_adaptive_lambda(lengths, gae.length_adaptive_alpha,
                                     floor=gae.lam if gae.lambda_floor else None)
    else:
        lam = gae.lam
    advantages, _ = advantage_fn(token_rewards, value_t, mask, finished, gae.gamma, lam, gae.edge_mask_tokens,
                                 next_values=next_values if gae.bootstrap == "next" else None)
    out = []
    for i, (row, outcome) in enumerate(zip(rows, outcomes)):
        n = len(row.new_token_ids)
        loss_mask = np.ones(n, dtype=np.uint8)
        if not row.finished and gae.edge_mask_tokens > 0:
            loss_mask[max(0, n - gae.edge_mask_tokens):] = 0
        out.append(TrainingRow(
            segment=row, score=shaped_scores[i], advantages=advantages[i, :n].float().numpy().copy(),
            correct=outcome.correct if outcome is not None else None, loss_mask=loss_mask,
            value_version=value_version,
        ))
    return out


def _value_tensors(rows: list[Segment], values: list[np.ndarray], outcomes: list[Outcome | None],
                   token_rewards_extra: list[np.ndarray] | None):
    """`[B, n_max]` float64 token rewards (the shaped outcome on a finished row's last token, its
    dense rewards on its slice, the extra per-token rewards), values and the policy mask, each row's
    value after its last token, and the shaped scores."""
    n_max = max(len(r.new_token_ids) for r in rows)
    batch = len(rows)
    token_rewards = torch.zeros(batch, n_max, dtype=torch.float64)
    value_t = torch.zeros(batch, n_max, dtype=torch.float64)
    mask = torch.zeros(batch, n_max, dtype=torch.float64)
    next_values = torch.zeros(batch, dtype=torch.float64)
    shaped_scores: list[float] = []
    for i, (row, v, outcome) in enumerate(zip(rows, values, outcomes)):
        n = len(row.new_token_ids)
        if len(v) != n + 1:
            raise ValueError(f"row {row.msg_id}: {len(v)} values for {n} tokens (expected n + 1)")
        # Policy positions only: GAE carries V and Â across an observation (`gae`'s masked positions).
        mask[i, :n] = torch.from_numpy(1.0 - observation_mask(row).astype(np.float64))
        value_t[i, :n] = torch.from_numpy(np.asarray(v[:n], dtype=np.float64))
        next_values[i] = float(v[n])
        if token_rewards_extra is not None:
            token_rewards[i, :n] += torch.from_numpy(np.asarray(token_rewards_extra[i], dtype=np.float64))
        score = 0.0
        if row.finished:
            if outcome is None:
                raise ValueError(f"finished row {row.msg_id} has no outcome")
            score = outcome.score
            if n:
                token_rewards[i, n - 1] += score
            if outcome.token_rewards is not None:
                # Dense (process) rewards of this row's slice of the response.
                offset = len(row.prior_response_ids)
                dense = np.asarray(outcome.token_rewards, dtype=np.float64)[offset : offset + n]
                token_rewards[i, : len(dense)] += torch.from_numpy(dense)
        shaped_scores.append(score)
    return token_rewards, value_t, mask, next_values, shaped_scores


def recorded_values(by_offset: dict[int, np.ndarray], response_tokens: int) -> np.ndarray | None:
    """The values a response's windows were valued with, keyed by each window's offset in the
    response, joined into one array; None unless they cover the response exactly (a window never
    valued: warm-up, a stale window)."""
    offsets, parts = sorted(by_offset), [by_offset[k] for k in sorted(by_offset)]
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist()
    if not parts or offsets != starts or sum(map(len, parts)) != response_tokens:
        return None
    return np.concatenate(parts).astype(np.float32)


def with_whole_response(sample: TrainingRow) -> TrainingRow:
    """The last window of a finished response as a row holding the whole response (T-PPO): the
    earlier windows become new tokens with loss mask 0 and advantage 0, so the policy loss still
    trains only this window while the positive-example NLL covers every generated token (the
    spec's "every generated token of finished, correct rows"). Their behaviour log-probs are not
    kept by the segment and are not needed: no loss ratio is taken there."""
    seg = sample.segment
    prior = len(seg.prior_response_ids)
    if not prior:
        return sample
    empty = np.zeros(0, dtype=np.int32)
    whole = msgspec.structs.replace(
        seg, prior_response_ids=empty, prior_versions=empty, new_token_ids=seg.response_ids,
        new_logprobs=np.concatenate([np.zeros(prior, dtype=np.float32), seg.new_logprobs]),
        new_versions=seg.response_versions,
        new_scored=None if seg.new_scored is None and seg.prior_observation is None else np.concatenate(
            [np.ones(prior, dtype=np.uint8) if seg.prior_observation is None else 1 - seg.prior_observation,
             scored_mask(seg).astype(np.uint8)]),
        new_observation=None if seg.new_observation is None and seg.prior_observation is None else np.concatenate(
            [np.zeros(prior, dtype=np.uint8) if seg.prior_observation is None else seg.prior_observation,
             observation_mask(seg).astype(np.uint8)]),
        prior_observation=None, new_routes=response_routes(seg), prior_routes=None)
    loss_mask = np.ones(len(seg.new_token_ids), dtype=np.uint8) if sample.loss_mask is None else sample.loss_mask
    return msgspec.structs.replace(
        sample, segment=whole,
        advantages=np.concatenate([np.zeros(prior, dtype=np.float32), sample.advantages]),
        loss_mask=np.concatenate([np.zeros(prior, dtype=np.uint8), loss_mask]))


def widen_positive_rows(samples: list[TrainingRow]) -> list[TrainingRow]:
    """`with_whole_response` for every finished positive row (see `is_positive`)."""
    return [with_whole_response(s) if s.segment.finished and is_positive(s.correct, s.score) else s
            for s in samples]


def _trained_advantages(samples: list[TrainingRow]) -> tuple[np.ndarray, np.ndarray]:
    flat = np.concatenate([s.advantages for s in samples]).astype(np.float64)
    mask = np.concatenate([s.loss_mask if s.loss_mask is not None else np.ones(len(s.advantages), dtype=np.uint8)
                           for s in samples]).astype(bool)
    return flat, mask


@dataclass
class RunningMoments:
    """Mean and variance of advantages over recent batches (exponentially weighted by batch).

    Why not per-batch whitening: in a stream a batch can hold only first windows of T-PPO rows,
    whose advantages are small value differences; whitening such a batch on its own would blow
    that noise up to unit scale. Whitening against the stream's recent moments keeps the scale of
    every batch comparable (the recipe's batches mix every window of a step, so it does not see this).
    """

    decay: float = 0.9
    mean: float = 0.0
    var: float = 1.0
    batches: int = 0

    def update(self, samples: list[TrainingRow]) -> None:
        flat, mask = _trained_advantages(samples)
        if mask.sum() < 2:
            return
        batch_mean, batch_var = float(flat[mask].mean()), float(flat[mask].var(ddof=1))
        if self.batches == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            d = self.decay
            delta = batch_mean - self.mean
            self.mean += (1 - d) * delta
            self.var = d * self.var + (1 - d) * batch_var + d * (1 - d) * delta**2
        self.batches += 1


def whiten_rows(samples: list[TrainingRow], clamp: float = 0.0, mean: float | None = None,
                std: float | None = None) -> list[TrainingRow]:
    """Whiten advantages over the trained tokens (loss mask), then clamp to ±clamp (0 = no clamp);
    excluded tokens stay 0. `mean`/`std` default to the batch's own (T-PPO recipe: whiten, then
    clamp to ±10); the assembler passes the stream's `RunningMoments`."""
    if not samples:
        return samples
    flat, mask = _trained_advantages(samples)
    x, m = torch.from_numpy(flat), torch.from_numpy(mask.astype(np.float64))
    if mean is None or std is None:
        if mask.sum() < 2:
            return samples
        whitened = masked_whiten(x, m).numpy()  # the batch's own moments
    else:
        whitened = masked_whiten(x, m, mean=mean, var=std**2).numpy()
    if clamp > 0:
        whitened = np.clip(whitened, -clamp, clamp)
    out, start = [], 0
    for s in samples:
        n = len(s.advantages)
        out.append(msgspec.structs.replace(s, advantages=whitened[start : start + n].astype(np.float32)))
        start += n
    return out

