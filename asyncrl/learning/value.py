"""The value model's side: values for (E)GAE, and one critic update on finished trajectories."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.learning.rows import (clip_and_step, device_of, layout_rows, length_sorted_chunks, micro_batches_of,
                                   row_length, width_of)
from asyncrl.schema import ScoredTrajectory, segment_row


@dataclass
class ValueLossSettings:
    gamma: float
    lam: float  # critic λ (1.0: Monte-Carlo targets)
    clip_low: float | None
    clip_high: float | None
    grad_clip: float
    micro_batch_tokens: int


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


def predict_values(value_model, rows: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int = 0,
                   max_tokens: int = 4096, with_next: bool = False) -> list[np.ndarray]:
    """`V(s_t)` for each new token of each (context, new) row: the state before the token. With
    `with_next`, one more value per row: the state after its last token."""
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for chunk in length_sorted_chunks(rows, max_tokens):
            layout = layout_rows([rows[i] for i in chunk], pad_token_id, device_of(value_model))
            values = value_model(layout.input_ids, layout.attention_mask).float().cpu()
            for j, i in enumerate(chunk):
                sl = layout.slices[j]
                stop = sl.stop + 1 if with_next else sl.stop
                by_index[i] = values[j, sl.start : stop].numpy().copy()
    return [by_index[i] for i in range(len(rows))]


def value_step(value_model, optimizer, trajectories: list[ScoredTrajectory], settings: ValueLossSettings,
               pad_token_id: int = 0) -> dict[str, float]:
    """One critic update on finished trajectories. Targets are GAE returns with the critic λ (λ=1:
    Monte-Carlo returns, independent of the values); the loss is the clipped value loss around the
    values recorded when each trajectory was valued for its advantages (the PPO recipe: the clip
    bounds how far the critic moves from the values the policy was trained with). A trajectory
    without recorded values (valued never: warm-up) is anchored at the pre-step values, where the
    clip cannot act. Token-mean over the batch."""
    from asyncrl.algo.advantages import critic_returns
    from asyncrl.algo.losses import value_loss

    if not all(t.segment.finished for t in trajectories):
        raise ValueError("the value model trains on finished trajectories only")
    trajectories = sorted(trajectories, key=lambda t: row_length(t.segment))  # see policy_step
    layout = layout_rows([segment_row(t.segment) for t in trajectories], pad_token_id, device_of(value_model))
    chunks = [(rows, slice(0, width_of(layout.attention_mask, rows)))
              for rows in micro_batches_of(layout, settings.micro_batch_tokens)]
    mask = layout.place([np.ones(len(t.segment.new_token_ids), dtype=np.float32) for t in trajectories])
    rewards = layout.place([trajectory_rewards(t) for t in trajectories])
    value_model.eval()
    old_values = torch.zeros(mask.shape, device=mask.device)
    with torch.no_grad():
        for sl in chunks:
            old_values[sl] = value_model(layout.input_ids[sl], layout.attention_mask[sl]).float()
    recorded = torch.tensor([t.values is not None for t in trajectories], device=mask.device)
    if bool(recorded.any()):
        placed = layout.place([t.values if t.values is not None else np.zeros(len(t.segment.new_token_ids))
                               for t in trajectories])
        old_values = torch.where(recorded[:, None], placed, old_values)
    old_values = old_values * mask
    # Positions run left to right through context then response; GAE walks only the masked ones.
    returns = critic_returns(rewards, old_values, mask, settings.gamma, settings.lam)
    total_tokens = max(float(mask.sum()), 1.0)
    value_model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"value_loss": 0.0, "value_clip_fraction": 0.0}
    for sl in chunks:
        values = value_model(layout.input_ids[sl], layout.attention_mask[sl])
        loss, metrics = value_loss(values, old_values[sl], returns[sl], mask[sl], settings.clip_low, settings.clip_high)
        share = float(mask[sl].sum()) / total_tokens
        (loss * share).backward()
        sums["value_loss"] += loss.item() * share
        sums["value_clip_fraction"] += metrics["value_clip_fraction"] * share
    grad_norm = clip_and_step(value_model, optimizer, settings.grad_clip)
    m = mask.bool()
    residual = (returns - old_values)[m]
    target_var = returns[m].var(unbiased=False)
    explained = 1.0 - float(residual.var(unbiased=False) / target_var) if float(target_var) > 1e-12 else 0.0
    return {**sums, "value_grad_norm": float(grad_norm), "value_explained_variance": explained,
            "value_mean": float(old_values[m].mean()), "return_mean": float(returns[m].mean()),
            "value_tokens": total_tokens, "value_trajectories": len(trajectories),
            "value_anchor_recorded_fraction": float(recorded.float().mean())}

