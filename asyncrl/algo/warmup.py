"""When a critic's warm-up (VC-PPO's value pretraining) has learned what it can (pure functions).

VC-PPO pretrains the value model under the frozen initial policy for a fixed number of steps (~50
at the paper's scale). A fixed count is wrong at any other scale: too short and the critic is
still a running mean, too long and the policy waits for nothing. The rule here: at least
`min_steps`, at most `max_steps`, and in between stop once the explained variance of the critic's
fresh values has not improved by `min_gain` over the best of the steps before the last `patience`.
"""

from __future__ import annotations


def warmup_finished(explained_variance: list[float], min_steps: int, max_steps: int, patience: int,
                    min_gain: float) -> bool:
    """`explained_variance`: one value per warm-up step so far (its fresh-value EV), oldest first."""
    steps = len(explained_variance)
    if steps >= max_steps:
        return True
    if steps < max(min_steps, patience + 1):
        return False
    best_before = max(explained_variance[:-patience])
    return max(explained_variance[-patience:]) < best_before + min_gain


def mean_return_bias(returns_sum: float, values_sum: float, tokens: float) -> float:
    """How much to add to a fresh critic's head bias so its mean value over `tokens` positions equals
    their mean return: the principled start of a critic that knows nothing else (a zero head starts
    at 0 while the returns may average far from it, and λ < 1 then throws the terminal reward away)."""
    return 0.0 if tokens <= 0 else (returns_sum - values_sum) / tokens
