"""Reward shaping and sample filters of DAPO (arXiv 2503.14476, docs/algorithms.md §5)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_tokens: int, factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment, added to the correctness reward.

    With `L_exp = max_length − buffer_tokens`: 0 for `|y| ≤ L_exp`, `(L_exp − |y|)/buffer · factor`
    inside the buffer, and `−factor` at or beyond `max_length` (verl's `min(−(len − L_exp)/buf, 0)`
    clipped at −1)."""
    if buffer_tokens <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    expected = max_length - buffer_tokens
    penalty = (expected - lengths.float()) / buffer_tokens
    return torch.clamp(penalty, min=-1.0, max=0.0) * factor


def shaped_score(score: float, response_tokens: int, max_response_tokens: int, buffer_tokens: int,
                 penalty_factor: float = 1.0) -> float:
    """A response's reward as every estimator and the critic see it: the endpoint's score plus the
    soft overlong penalty for its length (the assembler applies it once, when the reward arrives)."""
    penalty = overlong_penalty(torch.tensor([response_tokens]), max_response_tokens, buffer_tokens, penalty_factor)
    return float(score) + float(penalty[0])


def kl_reward(behaviour_logp: torch.Tensor, reference_logp: torch.Tensor, coef: float,
              estimator: str = "k1") -> torch.Tensor:
    """The PPO baseline's per-token KL penalty as a reward (docs/algorithms.md §1; verl `compute_rewards`
    with `use_kl_in_reward`): `r_t = −β·KL_t` with `KL_t` estimated from the behaviour log-prob
    `log π_old(a_t|s_t)` and the reference's (`k1`: `log π_old − log π_ref`). Added to the outcome
    and process rewards before (E)GAE, and to the return the critic learns."""
    from asyncrl.algo.losses import kl_penalty

    return -coef * kl_penalty(behaviour_logp, reference_logp, estimator)


def group_has_signal(scores: torch.Tensor) -> bool:
    """DAPO dynamic sampling keeps a group if its rewards are not all equal (or it has one member)."""
    return scores.numel() == 1 or bool((scores != scores[0]).any())


def filter_metric(correct: list[bool | None], scores: list[float], metric: str = "acc") -> torch.Tensor:
    """The values DAPO's dynamic sampling compares within a group (verl's `filter_groups.metric`).

    `acc`: correctness 1/0, so the overlong penalty cannot keep an all-wrong group alive; a reward
    with no correctness flag (a Bradley-Terry model, `correct=None`) falls back to the raw score for
    the whole group, since counting None as wrong would make every such group "no signal".
    `score`: the raw score (before shaping)."""
    if metric not in ("acc", "score"):
        raise ValueError(f"unknown filter metric {metric!r}")
    if metric == "acc" and all(c is not None for c in correct):
        return torch.tensor([1.0 if c else 0.0 for c in correct], dtype=torch.float64)
    return torch.tensor(scores, dtype=torch.float64)


def is_positive(correct: bool | None, score: float) -> bool:
    """A positive example (VAPO's self-imitation NLL): correct, or, for a reward with no
    correctness flag, a score above 0 (NeMo-RL's rule)."""
    return bool(correct) if correct is not None else score > 0.0


def symmetrized_preference(p_first_ab: torch.Tensor, p_first_ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise-RL position-swap averaging: `p(A≻B) = ½[P(first|A,B) + 1 − P(first|B,A)]`, so
    `p(A≻B) + p(B≻A) = 1` exactly. Also returns whether the two orders agree (the verdict survives
    the swap: A first in one order and A second in the other)."""
    p = 0.5 * (p_first_ab + 1.0 - p_first_ba)
    consistent = (p_first_ab > 0.5) == (p_first_ba < 0.5)
    return p, consistent


def prm_dense_rewards(line_scores: torch.Tensor, line_end_mask: torch.Tensor, neutral_mask: torch.Tensor,
                      passed: bool, lam_fail: float = 0.25, lam_pass: float = 0.025) -> torch.Tensor:
    """PRM DenseReward (arXiv 2410.17621): PRM scores at line-end tokens, weighted by λ (0.25 when
    the final code fails its tests, 0.025 when it passes) and divided by the number of scored lines
    (so the total is bounded by λ·max|score| whatever the line count); comment lines (`neutral_mask`)
    get 0. All `[T]`; returns `[T]`, non-zero only at scored line ends."""
    lam = lam_pass if passed else lam_fail
    scored = line_end_mask.bool() & ~neutral_mask.bool()
    n_lines = scored.sum().clamp(min=1)
    return torch.where(scored, lam * line_scores / n_lines, torch.zeros_like(line_scores))
