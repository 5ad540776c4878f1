"""DQO, Direct Q-function Optimization (arXiv 2410.09302; docs/algorithms.md §11): offline soft
actor-critic on the token MDP, with the Q-function parameterised through the language model.

Shapes: `[B, T]` over response tokens with a `mask`; responses are finished (the state after the
last token has value 0).

* `Q_θ(s_t, a_t) = β·log(π_θ/π_ref)(a_t|s_t) + V_φ(s_t)` (value stop-gradient in the policy loss).
* KL-regularised rewards `r̃_t = r_t − β·log(π_θ/π_ref)(a_t|s_t)` (detached).
* Soft λ-returns `G̃_t = r̃_t + γ[(1−λ)V(s_{t+1}) + λ G̃_{t+1}]` (= GAE(λ) returns over `r̃`,
  `asyncrl.algo.advantages.gae`): the value target.
* The Q target replaces the token's own KL term by its log-ratio inside Q:
  `Q̂_t = r_t + γ[(1−λ)V(s_{t+1}) + λ G̃_{t+1}] = G̃_t + β·log(π/π_ref)_t`.
* Offline tokens are weighted by the importance ratio to the behaviour policy, clipped to
  `[1 − c, 1 + c]` (without it DQO falls below DRO, Table 5).
"""

from __future__ import annotations

import torch

from asyncrl.algo.advantages import gae, masked_mean


def importance_weights(policy_logp: torch.Tensor, behaviour_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """`clip(π_θ/π_behaviour, 1 − c, 1 + c)` per token, no gradient (1 where π_θ = π_behaviour)."""
    ratio = torch.exp(torch.clamp(policy_logp.detach() - behaviour_logp, -20.0, 20.0))
    return ratio.clamp(1.0 - clip, 1.0 + clip)


def soft_targets(rewards: torch.Tensor, log_ratio: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 beta: float, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(value targets `G̃`, Q targets `Q̂`), both detached. `log_ratio` = `log π_θ − log π_ref` per
    token; `values` = `V(s_t)`. With λ = 1 and no KL, `G̃_t` is the sum of the rewards from t on."""
    log_ratio, values = log_ratio.detach(), values.detach()
    soft_rewards = (rewards - beta * log_ratio) * mask
    _, value_targets = gae(soft_rewards, values * mask, mask, gamma, lam)
    q_targets = (value_targets + beta * log_ratio) * mask
    return value_targets, q_targets


def dqo_losses(policy_logp: torch.Tensor, reference_logp: torch.Tensor, behaviour_logp: torch.Tensor,
               values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, beta: float, gamma: float = 1.0,
               lam: float = 1.0, importance_clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(policy loss, value loss, metrics): importance-weighted token means of the squared soft
    Bellman residuals `(Q_θ − Q̂)²` (gradient through `log π_θ` only) and `(V_φ − G̃)²`."""
    mask = mask.to(values.dtype)
    log_ratio = policy_logp - reference_logp
    value_targets, q_targets = soft_targets(rewards, log_ratio, values, mask, beta, gamma, lam)
    weights = importance_weights(policy_logp, behaviour_logp, importance_clip) * mask
    q = beta * log_ratio + values.detach()
    policy_loss = masked_mean(weights * (q - q_targets) ** 2, mask)
    value_loss = masked_mean(weights * (values - value_targets) ** 2, mask)
    with torch.no_grad():
        metrics = {
            "dqo_policy_loss": float(policy_loss), "dqo_value_loss": float(value_loss),
            "dqo_log_ratio_mean": float(masked_mean(log_ratio, mask)),
            "dqo_importance_weight_mean": float(masked_mean(weights, mask)),
            "dqo_importance_clip_fraction": float(masked_mean(
                ((weights <= 1.0 - importance_clip) | (weights >= 1.0 + importance_clip)).to(mask.dtype), mask)),
            "dqo_value_target_mean": float(masked_mean(value_targets, mask)),
        }
    return policy_loss, value_loss, metrics
