"""Advantage estimators (docs/algorithms.md §0-2, §4, §6, §7) and `ADVANTAGES`, the one mapping
from `algorithm.advantage.type` to the pure function that computes a sample's advantage.

Four kinds, by what the function needs (the assembly strategy that feeds it follows the kind):
* `group`: the shaped scores of one group `[G]` -> one advantage per sample `[G]`;
* `pairwise`: a group's symmetrised judge preferences `[G, G]` (or `[G, 1]`) -> `[G]`;
* `batch`: a batch's token rewards and masks `[B, T]` -> advantages `[B, T]` (REINFORCE++);
* `value`: token rewards, values, masks `[B, T]` (and `finished [B]`) -> (advantages, returns) `[B, T]`.

A key of `ADVANTAGES` is the `type` of a variant of `algorithm.advantage` (`asyncrl.config.algorithm`),
whose other fields are the function's keyword arguments. Adding an estimator is one pure function, one
entry below, one config variant and one YAML file under configs/algorithm/. This module imports
nothing of asyncrl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  mean: float | None = None, var: float | None = None) -> torch.Tensor:
    """Whiten over valid positions (unbiased variance, as verl's masked_whiten); masked positions
    are 0. `mean`/`var` given: whiten against those moments instead (the assembler's running ones)."""
    if mean is None or var is None:
        mean = masked_mean(x, mask)
        count = mask.sum()
        var = ((x - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1)
    var = torch.as_tensor(var, dtype=x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def last_valid_value(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`V` at each row's last valid position `[B]` (0 for an empty row)."""
    positions = torch.arange(values.shape[1], device=values.device).expand_as(values)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    return torch.where(last >= 0, values.gather(1, last.clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(values[:, 0]))


def egae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    finished: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    edge_mask_tokens: int = 0,
    next_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extended GAE on a window (T-PPO, arXiv 2506.15050 §3; docs/algorithms.md §6.3).

    Finished rows (`finished[b]` true) are ordinary GAE with bootstrap 0. Unfinished rows, cut at
    the window, bootstrap the missing `V(s_l)` with `V(s_{l-1})`, so the last TD error is
    `(γ−1)·V_{l−1}` (0 for γ=1). `next_values` `[B]`, when given, is the value model's actual
    `V(s_l)` (the state after the window's last token) and replaces that approximation. For
    unfinished rows the advantages of the last `edge_mask_tokens` valid tokens are set to 0 (they
    depend almost only on the bootstrap). Returns `(advantages, returns)`; returns (critic targets)
    are zeroed on unfinished rows, which have none.
    """
    finished = finished.to(values.dtype)
    cut_value = last_valid_value(values, mask) if next_values is None else next_values.to(values.dtype)
    bootstrap = (1.0 - finished) * cut_value
    advantages, returns = gae(token_rewards, values, mask, gamma, lam, bootstrap=bootstrap)
    if edge_mask_tokens > 0:
        # Rank positions from the end among valid tokens: 1 = last valid token.
        from_end = torch.flip(torch.cumsum(torch.flip(mask.to(values.dtype), [1]), dim=1), [1]) * mask
        edge = (from_end > 0) & (from_end <= edge_mask_tokens) & (finished[:, None] == 0)
        advantages = advantages.masked_fill(edge, 0.0)
    return advantages, returns * finished[:, None]


def critic_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam_critic: float = 1.0,
) -> torch.Tensor:
    """The value learner's targets: GAE returns with the critic's own λ (VC-PPO decoupled λ,
    arXiv 2503.01491). The policy's advantages use the policy λ (`egae`), so with
    `lam_critic=1.0` the targets are unbiased Monte-Carlo returns whatever the values are."""
    _, returns = gae(token_rewards, values, mask, gamma, lam_critic)
    return returns


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05, floor: float | None = None) -> torch.Tensor:
    """VAPO length-adaptive λ = 1 − 1/(α·l) per row (arXiv 2504.05118).

    `floor=None` clamps as NeMo-RL does: `1 − 1/max(α·l, 1)` then into [0, 1] (0 for l ≤ 1/α).
    `floor=λ_base` is the T-PPO recipe: `max(1 − 1/(α·l), λ_base)`.
    """
    scaled = alpha * lengths.to(torch.float64)
    if floor is None:
        return (1.0 - 1.0 / scaled.clamp(min=1.0)).clamp(0.0, 1.0)
    return torch.clamp(1.0 - 1.0 / scaled.clamp(min=1e-12), min=floor)


def tppo_lambda_lengths(generated: torch.Tensor, finished: torch.Tensor, window_tokens: int) -> torch.Tensor:
    """The length fed to length-adaptive λ in T-PPO: the generated length for finished rows, plus a
    guess of W/2 remaining tokens for unfinished ones (docs/algorithms.md §6.3)."""
    return generated.to(torch.float64) + (~finished.bool()).to(torch.float64) * (window_tokens / 2)


def pairwise_advantages(preferences: torch.Tensor) -> torch.Tensor:
    """Pairwise PPO within a group (Pairwise-RL, arXiv 2504.04950): `preferences[i, j] = p(y_i ≻ y_j)`
    (symmetrised, so `p_ij + p_ji = 1`; the diagonal is ignored). A response's advantage is its mean
    win probability against the others, centred at parity: `2·(mean_j p_ij − 0.5) ∈ [−1, 1]`. Against
    a single reference anchor pass `[G, 1]` (column j = the anchor): `2·(p(y_i ≻ y_ref) − 0.5)`."""
    g, k = preferences.shape
    p = preferences.double()
    if k == g and g > 1:
        off_diagonal = ~torch.eye(g, dtype=torch.bool)
        mean_win = (p * off_diagonal).sum(1) / (g - 1)
    else:
        mean_win = p.mean(1)
    return (2.0 * (mean_win - 0.5)).float()


def judged_pairs(group_size: int, against_reference: bool) -> list[tuple[int, int | None]]:
    """The comparisons Pairwise PPO asks the judge for: every unordered pair of the group (i < j),
    or each response against the reference (j = None)."""
    if against_reference:
        return [(i, None) for i in range(group_size)]
    return [(i, j) for i in range(group_size) for j in range(i + 1, group_size)]


def preference_matrix(group_size: int, pairs: list[tuple[int, int | None]], p_first: list[float]) -> torch.Tensor:
    """Symmetrised verdicts -> the `preferences` of `pairwise_advantages`: `[G, G]` with
    `p_ji = 1 − p_ij` (diagonal 0.5), or `[G, 1]` against the reference. Unjudged entries are 0.5."""
    against_reference = any(j is None for _, j in pairs)
    prefs = torch.full((group_size, 1 if against_reference else group_size), 0.5, dtype=torch.float64)
    for (i, j), p in zip(pairs, p_first):
        if j is None:
            prefs[i, 0] = p
        else:
            prefs[i, j], prefs[j, i] = p, 1.0 - p
    return prefs


def group_normalised(scores: torch.Tensor) -> torch.Tensor:
    """GRPO: one group's `[G]` scores -> `(R_i − mean) / (std + eps)` (DeepSeekMath §4.1.2)."""
    return grpo_advantages(scores, torch.zeros(len(scores), dtype=torch.long))


def group_centred(scores: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (arXiv 2503.20783): one group's `[G]` scores -> `R_i − mean`, not divided by the std."""
    return grpo_advantages(scores, torch.zeros(len(scores), dtype=torch.long), scale_by_std=False)


def leave_one_out(scores: torch.Tensor) -> torch.Tensor:
    """RLOO (arXiv 2402.14740; verl's `rloo`): one group's `[G]` scores -> `R_i − mean_{j≠i} R_j`,
    written as verl does, `R_i·G/(G−1) − mean·G/(G−1)`. A group of one keeps its score."""
    scores = scores.double()
    g = len(scores)
    if g < 2:
        return scores.float()
    return (scores * g / (g - 1) - scores.mean() * g / (g - 1)).float()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """`G_t = r_t + γ·G_{t+1}` within each row's valid positions `[B, T]` (0 where `mask` is 0: the
    return restarts after each row's end, as verl's REINFORCE++ does)."""
    returns = torch.zeros_like(token_rewards, dtype=torch.float64)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float64)
    mask = mask.to(torch.float64)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t].double() + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns * mask


def reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                        trained: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262; verl's `reinforce_plus_plus`): the discounted returns of each
    row's token rewards `[B, T]` (the outcome on the last token, process rewards where they fall),
    whitened over the batch's trained tokens (`trained`, default `mask`; unbiased variance, as
    verl's `masked_whiten`). No critic and no group baseline. Returns `[B, T]`, 0 off `trained`."""
    trained = mask if trained is None else trained
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, trained.to(torch.float64)).float()


@dataclass(frozen=True)
class Estimator:
    """An estimator: its kind (what it is fed, see the module docstring) and its pure function."""

    kind: str  # group | pairwise | batch | value
    fn: Callable


# The one mapping from `algorithm.advantage.type` to its function.
ADVANTAGES: dict[str, Estimator] = {
    "grpo": Estimator("group", group_normalised),
    "drgrpo": Estimator("group", group_centred),
    "rloo": Estimator("group", leave_one_out),
    "reinforce_plus_plus": Estimator("batch", reinforce_plus_plus),
    "pairwise": Estimator("pairwise", pairwise_advantages),
    "gae": Estimator("value", egae),
}
