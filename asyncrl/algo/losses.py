"""Policy losses, aggregation, KL estimators (verl `core_algos.py` conventions, docs/algorithms.md §0, §5).

Shapes: `[B, T]` per-token tensors with a 0/1 `mask`. Losses are returned with a metrics dict of
plain floats.
"""

from __future__ import annotations

import torch


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm_constant: float | None = None) -> torch.Tensor:
    """Aggregate per-token losses.

    token-mean: Σ loss / Σ mask (DAPO token-level loss); seq-mean-token-mean: mean over tokens,
    then over sequences (GRPO); seq-mean-token-sum: sum over tokens, mean over sequences;
    seq-mean-token-sum-norm: total sum / constant (Dr.GRPO; default constant = padded length T).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    seq_has_tokens = (mask.sum(-1) > 0).to(loss_mat.dtype)
    n_seq = seq_has_tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return (per_seq * seq_has_tokens).sum() / n_seq
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        constant = float(loss_mat.shape[-1]) if norm_constant is None else norm_constant
        return (loss_mat * mask).sum() / constant
    raise ValueError(f"unknown loss aggregation {mode!r}")


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
    proximal_logp: torch.Tensor | None = None,
    behaviour_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with decoupled clip (DAPO clip-higher) and optional dual clip.

    Per token: `ℓ = max(−Â ρ, −Â clip(ρ, 1−ε_low, 1+ε_high))`, and for `Â < 0` capped at `−Â c`
    (dual clip, Ye et al. 2020; verl `compute_policy_loss_vanilla`). `norm_constant` is
    the divisor of `seq-mean-token-sum-norm` (default: padded length). `ρ = exp(clamp(logπ − logπ_old,
    ±20))`. Metrics: clip fractions and the approximate KL `mean(−log ρ)` over valid tokens.

    Decoupled PPO (AReaL, arXiv 2505.24298), when `proximal_logp` is given: the clip is taken
    around the proximal policy, `ρ = π_θ/π_prox`, and each token's loss is multiplied by
    `behaviour_weight` (no gradient; `behaviour_weights`: the truncated or masked ratio π_prox/π_old).
    With `π_prox = π_old` and weight 1 it is the plain loss.
    """
    mask = mask.to(logp.dtype)
    anchor = old_logp if proximal_logp is None else proximal_logp
    log_ratio = torch.clamp(logp - anchor, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipped_mask = (clipped > unclipped).to(logp.dtype)
    dual_mask = torch.zeros_like(loss_mat)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.minimum(loss_mat, -advantages * dual_clip)
        dual_mask = ((advantages < 0) & (capped < loss_mat)).to(logp.dtype)
        loss_mat = torch.where(advantages < 0, capped, loss_mat)
    if behaviour_weight is not None:
        loss_mat = loss_mat * behaviour_weight.detach()
    loss = agg_loss(loss_mat, mask, agg, norm_constant)
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {
            "clip_fraction": float((clipped_mask * mask).sum() / n),
            "clip_fraction_high": float((((ratio > 1 + clip_high) & (advantages > 0)).to(logp.dtype) * mask).sum() / n),
            "clip_fraction_low": float((((ratio < 1 - clip_low) & (advantages < 0)).to(logp.dtype) * mask).sum() / n),
            "dual_clip_fraction": float((dual_mask * mask).sum() / n),
            "approx_kl": float((-log_ratio * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
        if behaviour_weight is not None:
            metrics["behaviour_weight_mean"] = float((behaviour_weight * mask).sum() / n)
    return loss, metrics


def behaviour_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                      mode: str = "token_tis", cap: float = 2.0) -> torch.Tensor:
    """Importance weights `[B, T]` (no gradient) correcting for tokens sampled by a behaviour policy
    other than the learner's proximal one: staleness, or the rollout engine's other kernels and
    precision (rollout-training mismatch). `r = π_prox/π_behaviour` per token; a row's `R = Π_t r_t`.

    * `token_tis`: `min(r_t, C)` (truncated importance sampling, per token);
    * `sequence_tis`: `min(R, C)` for every token of the row;
    * `token_mis`: `r_t` where `1/C <= r_t <= C`, else 0 (masked: the token carries no loss);
    * `sequence_mis`: `R` for a row with `1/C <= R <= C`, else 0 for the whole row.
    """
    if mode not in ("token_tis", "sequence_tis", "token_mis", "sequence_mis"):
        raise ValueError(f"unknown behaviour correction {mode!r}")
    if cap < 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    mask = mask.to(proximal_logp.dtype)
    log_r = torch.clamp(proximal_logp - behaviour_logp, -20.0, 20.0).detach() * mask
    if mode.startswith("sequence"):
        log_r = torch.clamp(log_r.sum(-1, keepdim=True), -20.0, 20.0).expand_as(log_r)
    r = torch.exp(log_r)
    if mode.endswith("tis"):
        return r.clamp(max=cap) * mask
    inside = (r >= 1.0 / cap) & (r <= cap)
    return torch.where(inside, r, torch.zeros_like(r)) * mask


def rollout_mismatch(learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the behaviour log-probs (the engine's) are from the learner's for the same weights:
    KL(π_behaviour ‖ π_learner) estimated on the sampled tokens (k1 `log b − log θ`, and k3
    `θ/b − log(θ/b) − 1`, always >= 0), and the extremes of the ratio `π_learner/π_behaviour`."""
    mask = mask.to(learner_logp.dtype)
    n = mask.sum().clamp(min=1)
    log_r = torch.clamp(learner_logp - behaviour_logp, -20.0, 20.0).detach()
    ratio = torch.exp(log_r)
    valid = mask > 0
    return {"rollout_kl_k1": float((-log_r * mask).sum() / n),
            "rollout_kl_k3": float(((ratio - log_r - 1.0) * mask).sum() / n),
            "rollout_ratio_max": float(ratio[valid].max()) if bool(valid.any()) else 1.0,
            "rollout_ratio_min": float(ratio[valid].min()) if bool(valid.any()) else 1.0}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimators (Schulman, "Approximating KL divergence"; verl names).
    k1 (`kl`): `logπ − logπ_ref`; k2 (`mse`): `½(logπ − logπ_ref)²`; k3 (`low_var_kl`):
    `π_ref/π − log(π_ref/π) − 1`, clamped to ±10 as in verl."""
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp) ** 2
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of log-probabilities; entries of −inf (a truncated distribution's
    excluded tokens) contribute 0, not NaN."""
    finite = torch.isfinite(logp)
    safe = torch.where(finite, logp, torch.zeros_like(logp))
    return -(safe.exp() * finite * safe).sum(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | None = 0.5,
    clip_high: float | None = 0.5,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss `0.5·agg(max((V−G)², (clip(V, V_old−ε_low, V_old+ε_high) − G)²))` (verl;
    T-PPO clips asymmetrically, 0.5/0.6). `clip_low=clip_high=None` is the plain squared error."""
    unclipped = (values - returns) ** 2
    if clip_low is None or clip_high is None:
        loss_mat = unclipped
        clipped_frac = 0.0
    else:
        clipped_values = torch.maximum(torch.minimum(values, old_values + clip_high), old_values - clip_low)
        clipped = (clipped_values - returns) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        m = mask.to(values.dtype)
        clipped_frac = float(((clipped > unclipped).to(values.dtype) * m).sum() / m.sum().clamp(min=1))
    loss = 0.5 * agg_loss(loss_mat, mask, agg)
    return loss, {"value_clip_fraction": clipped_frac}


def positive_example_nll(logp: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor,
                         normalizer: float | None = None) -> torch.Tensor:
    """VAPO self-imitation term: mean of −log π over the tokens of correct responses (`correct` `[B]`),
    normalised by their token count; exactly 0 (not NaN) when no response is correct. A learner
    that splits a batch into micro-batches passes the whole batch's count as `normalizer`, so the
    micro-batch terms add up to the batch's mean."""
    m = mask.to(logp.dtype) * correct.to(logp.dtype)[:, None]
    count = m.sum().clamp(min=1) if normalizer is None else max(float(normalizer), 1.0)
    return -(logp * m).sum() / count


def router_balance_loss(router_logits: list[torch.Tensor], top_k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The auxiliary load-balancing loss of a mixture-of-experts model (Switch Transformer's, as
    transformers' MoE families compute it): over every (token, sparse layer) pair at the real
    positions `valid` (`[T]` bool; None: all), `E * sum_e f_e * P_e`, where `f_e` is the share of
    the (token, slot) top-`top_k` choices of the router's own softmax that went to expert `e`
    (counted, no gradient) and `P_e` the router's mean probability of `e`: `top_k` when both are
    uniform, larger when the router sends more of its mass where it routes more tokens. `router_logits`: one
    `[T, E]` tensor per sparse layer."""
    logits = torch.cat(router_logits) if valid is None else torch.cat([layer[valid] for layer in router_logits])
    experts = logits.shape[-1]
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, experts).float()  # [N, k, E]
    tokens_per_expert = chosen.mean(dim=0)  # [k, E]: per slot, the share of tokens sent to each expert
    return experts * (tokens_per_expert * probs.mean(dim=0)).sum()
