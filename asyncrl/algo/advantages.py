"""Advantage estimators: GRPO group normalisation and GAE (verl conventions, ALGORITHMS.md §0-2).

Shapes: `[B, T]` tensors with a 0/1 `mask` over valid response tokens.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    scores: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """Group-relative advantage `(R_i - mean_g) / (std_g + eps)` per sample (DeepSeekMath §4.1.2).

    `scores` `[B]`, `group_index` `[B]` (integers naming the group). The std is the unbiased
    (n-1) estimator as in verl; a group of one gets mean 0 and std 1. `scale_by_std=False` is
    Dr.GRPO (centre only). Returns `[B]`; broadcast over tokens by the caller.
    """
    scores = scores.double()
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (scores - means[inverse]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    mean_per_row = torch.where(counts[inverse] > 1, means[inverse], torch.zeros_like(scores))
    std_per_row = torch.where(counts[inverse] > 1, std[inverse], torch.ones_like(scores))
    centred = scores - mean_per_row
    out = centred / (std_per_row + eps) if scale_by_std else centred
    return out.float()


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, unwhitened. Returns `(advantages, returns)` `[B, T]`.

    `δ_t = r_t + γ V_{t+1} − V_t`, `Â_t = δ_t + γλ Â_{t+1}`, returns `= Â + V`. Walking backwards,
    masked positions carry `V_{t+1}` and `Â_{t+1}` through unchanged (verl's carry-forward), so
    padding inside a response adds no TD terms. `lam` is a float or a per-row tensor `[B]`.
    `bootstrap` `[B]` is `V(s_L)` after the last token (0 for finished rows; EGAE passes the last
    value for rows cut at a window).
    """
    batch, length = token_rewards.shape
    lam_row = torch.as_tensor(lam, dtype=values.dtype).expand(batch) if not torch.is_tensor(lam) else lam.to(values.dtype)
    next_value = torch.zeros(batch, dtype=values.dtype) if bootstrap is None else bootstrap.to(values.dtype)
    last_adv = torch.zeros(batch, dtype=values.dtype)
    advantages = torch.zeros_like(values)
    mask = mask.to(values.dtype)
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_row * last_adv
        valid = mask[:, t]
        next_value = valid * values[:, t] + (1 - valid) * next_value
        last_adv = valid * adv + (1 - valid) * last_adv
        advantages[:, t] = last_adv
    returns = advantages + values
    return advantages * mask, returns * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over valid positions (unbiased variance, as verl's masked_whiten)."""
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask
