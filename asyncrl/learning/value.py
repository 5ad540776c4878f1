"""The value model's side: values for (E)GAE, and one critic update on finished trajectories."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import torch

from asyncrl.config import CriticConfig
from asyncrl.learning.routing import replayed_routes
from asyncrl.learning.tensors import (autocast, clip_and_step, device_of, layout_rows, length_sorted_chunks, micro_batches_of,
                                      row_length, row_routes, segment_images, width_of)
from asyncrl.messages.structs import ScoredTrajectory, observation_mask, routed_row


def trajectory_rewards(trajectory: ScoredTrajectory) -> np.ndarray:
    """Per-token rewards of a finished response: dense rewards (if any) plus the score on the last token."""
    n = len(trajectory.segment.new_token_ids)
    rewards = np.zeros(n, dtype=np.float32)
    if trajectory.token_rewards is not None:
        m = min(n, len(trajectory.token_rewards))
        rewards[:m] = trajectory.token_rewards[:m]
    if n:
        rewards[-1] += trajectory.score
    return rewards


def predict_values(value_model, rows: list[tuple], pad_token_id: int = 0, max_tokens: int = 4096,
                   with_next: bool = False, precision: str = "fp32", replay: bool = False,
                   images: list[tuple[str, ...]] | None = None) -> list[np.ndarray]:
    """`V(s_t)` for each new token of each (context, new) row: the state before the token. With
    `with_next`, one more value per row: the state after its last token. `replay`: a row's routes
    (`routed_row`'s third item) are replayed on a mixture-of-experts critic; `images`: each row's
    processed images (a vision-language critic: the tower once per distinct image of a chunk)."""
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad(), autocast(value_model, precision):
        for chunk in length_sorted_chunks(rows, max_tokens):
            layout = layout_rows([rows[i] for i in chunk], pad_token_id, device_of(value_model))
            with replayed_routes(value_model, row_routes(layout, [rows[i] for i in chunk]), replay):
                values = value_model(layout.input_ids, layout.attention_mask,
                                     **_images_of(images, chunk)).float().cpu()
            for j, i in enumerate(chunk):
                sl = layout.slices[j]
                stop = sl.stop + 1 if with_next else sl.stop
                by_index[i] = values[j, sl.start : stop].numpy().copy()
    return [by_index[i] for i in range(len(rows))]


def _images_of(images: list[tuple[str, ...]] | None, rows) -> dict:
    """The critic's `images` argument for these rows (a list of indices or a slice); none when no row
    has any, so a critic of any trunk (a reward model's) is called as before."""
    if images is None or not any(images):
        return {}
    return {"images": [images[i] for i in rows] if isinstance(rows, list) else images[rows]}


def value_step(value_model, optimizer, trajectories: list[ScoredTrajectory], critic: CriticConfig, gamma: float,
               pad_token_id: int = 0, replay: bool = False,
               window: ExplainedVarianceWindow | None = None) -> dict[str, float]:
    """One critic update on finished trajectories. Targets are GAE returns with the critic λ (λ=1:
    Monte-Carlo returns, independent of the values); the loss is the clipped value loss around the
    values recorded when each trajectory was valued for its advantages (the PPO recipe: the clip
    bounds how far the critic moves from the values the policy was trained with). A trajectory
    without recorded values (valued never: warm-up) is anchored at the pre-step values, where the
    clip cannot act. Token-mean over the batch.

    One forward per micro-batch: the pre-step values are that forward's own output (the weights
    change only after every micro-batch), and GAE runs row by row, so a micro-batch's returns need
    only its own rows. The explained variance is measured on those fresh values (the critic as it is
    now); `value_explained_variance_recorded` on the recorded anchors (what the rows were valued with).
    `critic`: its section, with `compute.precision` resolved; `gamma`: the advantage's discount; `replay`:
    a MoE critic's rollout routes (`asyncrl.learning.routing`); `window`: the learner's last batches."""
    from asyncrl.algo.advantages import critic_returns
    from asyncrl.algo.losses import value_loss

    if not all(t.segment.finished for t in trajectories):
        raise ValueError("the value model trains on finished trajectories only")
    trajectories = sorted(trajectories, key=lambda t: row_length(t.segment))  # see policy_step
    rows = [routed_row(t.segment) for t in trajectories]
    images = segment_images([t.segment for t in trajectories])
    layout = layout_rows(rows, pad_token_id, device_of(value_model))
    routes = row_routes(layout, rows)
    chunks = [(part, slice(0, width_of(layout.attention_mask, part)))
              for part in micro_batches_of(layout, critic.compute.micro_batch_tokens)]
    mask, rewards, recorded, placed = _placed_targets(layout, trajectories)
    fresh, anchors, returns = (torch.zeros(mask.shape, device=mask.device) for _ in range(3))
    vision = getattr(value_model, "vision", None)  # a vision-language critic's tower, timed
    vision_start = vision.seconds if vision is not None else 0.0
    total_tokens = max(float(mask.sum()), 1.0)
    value_model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"value_loss": 0.0, "value_clip_fraction": 0.0}
    for sl in chunks:
        with replayed_routes(value_model, None if routes is None else routes[sl], replay):
            with autocast(value_model, critic.compute.precision):
                values = value_model(layout.input_ids[sl], layout.attention_mask[sl],
                                     **_images_of(images, sl[0]))  # float32 (the head's)
            fresh[sl] = values.detach() * mask[sl]
            anchors[sl] = torch.where(recorded[sl[0], None], placed[sl], fresh[sl]) * mask[sl]
            # Positions run left to right through context then response; GAE walks only the masked ones.
            returns[sl] = critic_returns(rewards[sl], anchors[sl], mask[sl], gamma, critic.loss.lam)
            loss, metrics = value_loss(values, anchors[sl], returns[sl], mask[sl], critic.loss.clip_low,
                                       critic.loss.clip_high)
            share = float(mask[sl].sum()) / total_tokens
            (loss * share).backward()
        sums["value_loss"] += loss.item() * share
        sums["value_clip_fraction"] += metrics["value_clip_fraction"] * share
    grad_norm = clip_and_step(value_model, optimizer, critic.optimizer.grad_clip)
    return {**sums, "value_grad_norm": float(grad_norm), "value_tokens": total_tokens,
            **_fit_metrics(returns, fresh, anchors, mask.bool(), window),
            "value_trajectories": len(trajectories), "value_anchor_recorded_fraction": float(recorded.float().mean()),
            # The newest policy version the batch was generated with: a step record's weight_version
            # less this is how far behind the policy the critic is learning.
            "value_batch_policy_version": float(max(int(t.segment.new_versions.max(initial=0)) for t in trajectories)),
            **({"value_vision_s": vision.seconds - vision_start} if vision is not None else {})}


def _placed_targets(layout, trajectories: list[ScoredTrajectory]) -> tuple[torch.Tensor, ...]:
    """`[B, L]` tensors of what the critic's loss reads: the positions it values, the rewards, whether
    each row's values were recorded (`[B]`), and those values (0 where not)."""
    # The critic values policy positions only: an observation is not an action (`gae` carries V and
    # Â across it).
    mask = layout.place([1.0 - observation_mask(t.segment).astype(np.float32) for t in trajectories])
    rewards = layout.place([trajectory_rewards(t) for t in trajectories])
    recorded = torch.tensor([t.values is not None for t in trajectories], device=mask.device)
    placed = layout.place([t.values if t.values is not None else np.zeros(len(t.segment.new_token_ids))
                           for t in trajectories])
    return mask, rewards, recorded, placed


def _fit_metrics(returns: torch.Tensor, fresh: torch.Tensor, anchors: torch.Tensor, m: torch.Tensor,
                 window: ExplainedVarianceWindow | None) -> dict[str, float]:
    if window is not None:
        window.add(returns[m], fresh[m])
    return {"value_explained_variance": explained_variance(returns[m], fresh[m]),
            "value_explained_variance_recorded": explained_variance(returns[m], anchors[m]),
            **({"value_explained_variance_window": window.explained_variance()} if window is not None else {}),
            "value_mean": float(fresh[m].mean()), "return_mean": float(returns[m].mean())}


def explained_variance(targets: torch.Tensor, predictions: torch.Tensor) -> float:
    """1 − Var(targets − predictions) / Var(targets) (0 when the targets do not vary)."""
    target_var = targets.var(unbiased=False)
    if float(target_var) <= 1e-12:
        return 0.0
    return 1.0 - float((targets - predictions).var(unbiased=False) / target_var)


def dealt_batches(trajectories: list[ScoredTrajectory], size: int) -> list[list[ScoredTrajectory]]:
    """`trajectories` dealt into batches of `size` round-robin across their groups (each group's
    order kept): two groups of 32 give four batches of 8 + 8."""
    groups: dict[str, list[ScoredTrajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.segment.group_id, []).append(t)
    order = [t for rank in itertools.zip_longest(*groups.values()) for t in rank if t is not None]
    return [order[i:i + size] for i in range(0, len(order), size)]


class ExplainedVarianceWindow:
    """The explained variance of a critic's last `batches` batches pooled (their targets and fresh
    values). One batch of 16 two-token responses whose rewards are nearly all 0 (or all 1) has
    targets that barely vary, and its explained variance swings from -10^4 to 1 with noise; pooled
    over several batches the figure says whether the critic has learned."""

    def __init__(self, batches: int = 8):
        self.parts: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque(maxlen=batches)

    def add(self, targets: torch.Tensor, predictions: torch.Tensor) -> None:
        self.parts.append((targets.detach().double().cpu(), predictions.detach().double().cpu()))

    def explained_variance(self) -> float:
        return explained_variance(torch.cat([t for t, _ in self.parts]), torch.cat([p for _, p in self.parts]))


def center_value_head(value_model, trajectories: list[ScoredTrajectory], gamma: float, pad_token_id: int = 0,
                      max_tokens: int = 4096, precision: str = "fp32", replay: bool = False) -> float:
    """Start a fresh critic at the mean Monte-Carlo return of `trajectories` (the initial policy's
    first ones): its head's bias moves so that the mean value over their response tokens equals
    their mean return. Returns the shift."""
    from asyncrl.algo.advantages import critic_returns
    from asyncrl.algo.warmup import mean_return_bias

    rows = [routed_row(t.segment) for t in trajectories]
    values = predict_values(value_model, rows, pad_token_id, max_tokens, precision=precision, replay=replay,
                            images=segment_images([t.segment for t in trajectories]))
    returns_sum, values_sum, tokens = 0.0, 0.0, 0
    for t, v in zip(trajectories, values):
        rewards = torch.from_numpy(trajectory_rewards(t)).double()[None]
        mask = torch.ones_like(rewards)
        returns_sum += float(critic_returns(rewards, torch.zeros_like(rewards), mask, gamma, 1.0).sum())
        values_sum += float(np.sum(v))
        tokens += len(v)
    shift = mean_return_bias(returns_sum, values_sum, tokens)
    with torch.no_grad():
        value_model.head.bias.add_(shift)
    return shift
