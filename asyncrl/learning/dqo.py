"""The DQO update (forward, backward, step) over finished trajectories; the maths are the pure
functions of `asyncrl.algo.dqo`. The policy and the value model each have their optimizer; one
call is one update of both, micro-batched by tokens (the token means add up exactly)."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.algo.dqo import dqo_losses
from asyncrl.config import CriticConfig, DQOConfig, PolicyConfig, SamplingConfig
from asyncrl.learning.scoring import token_logprobs
from asyncrl.learning.tensors import clip_and_step, device_of, layout_rows, micro_batches_of, row_length, width_of
from asyncrl.learning.value import trajectory_rewards
from asyncrl.messages.structs import ScoredTrajectory, segment_row


def dqo_step(policy, value_model, policy_optimizer, value_optimizer, trajectories: list[ScoredTrajectory],
             reference_logprobs: list[np.ndarray], dqo: DQOConfig, sections: tuple[PolicyConfig, CriticConfig,
                                                                                  SamplingConfig],
             pad_token_id: int = 0) -> dict[str, float]:
    """One DQO update on finished trajectories. `trajectory.segment.new_logprobs` are the behaviour
    log-probs (the recorded ones, or the reference's for data sampled from it);
    `reference_logprobs[i]` are π_ref's for trajectory i's response tokens. `sections`: the policy's
    (its micro-batches, its gradient clip), the critic's (its gradient clip) and the sampling
    distribution of the data (log-probs are scored under its temperature)."""
    policy_section, critic, sampling = sections
    order = sorted(range(len(trajectories)), key=lambda i: row_length(trajectories[i].segment))
    trajectories = [trajectories[i] for i in order]
    reference_logprobs = [reference_logprobs[i] for i in order]
    layout = layout_rows([segment_row(t.segment) for t in trajectories], pad_token_id, device_of(policy))
    ones = [np.ones(len(t.segment.new_token_ids), dtype=np.float32) for t in trajectories]
    mask = layout.place(ones)
    targets = layout.place([t.segment.new_token_ids for t in trajectories], torch.long)
    behaviour = layout.place([t.segment.new_logprobs for t in trajectories])
    reference = layout.place(reference_logprobs)
    rewards = layout.place([trajectory_rewards(t) for t in trajectories])
    total_tokens = max(float(mask.sum()), 1.0)
    policy.train()
    value_model.train()
    policy_optimizer.zero_grad(set_to_none=True)
    value_optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for rows in micro_batches_of(layout, policy_section.compute.micro_batch_tokens):
        sl = (rows, slice(0, width_of(layout.attention_mask, rows)))
        m = mask[sl]
        logp, _ = token_logprobs(policy, layout.input_ids[sl], layout.attention_mask[sl], targets[sl],
                                 sampling.temperature, positions=m > 0)
        # V(s_t) at the position before each response token: the value model's output at the
        # positions the policy's logits are read from (`RowLayout.slices`).
        values = value_model(layout.input_ids[sl], layout.attention_mask[sl]) * m
        policy_loss, value_loss, metrics = dqo_losses(
            logp, reference[sl], behaviour[sl], values, rewards[sl], m, dqo.beta, dqo.gamma, dqo.lam,
            dqo.importance_clip)
        share = float(m.sum()) / total_tokens
        ((policy_loss + value_loss) * share).backward()
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * share
    policy_grad = clip_and_step(policy, policy_optimizer, policy_section.optimizer.grad_clip)
    value_grad = clip_and_step(value_model, value_optimizer, critic.optimizer.grad_clip)
    return {**sums, "grad_norm": float(policy_grad), "value_grad_norm": float(value_grad),
            "tokens_trained": total_tokens, "rows_trained": len(trajectories)}
