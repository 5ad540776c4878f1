"""Prompt selection and curriculum (Data-scaling RLHF, arXiv 2503.22230 §"Pre-PPO"; docs/algorithms.md §8).

Pure functions over per-prompt scores and domains (a prompt's `data_source`).
"""

from __future__ import annotations

import math

import numpy as np

from asyncrl.algo.shaping import filter_metric, group_has_signal


def domain_zscores(scores: np.ndarray, domains: list[str], valid: np.ndarray | None = None) -> np.ndarray:
    """Scores standardised within each domain (score distributions differ by domain), over the
    `valid` entries (default all; invalid ones get z = 0). A domain with one valid prompt or zero
    spread gets z = 0."""
    scores = np.asarray(scores, dtype=np.float64)
    valid = np.ones(len(scores), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    z = np.zeros_like(scores)
    for domain in set(domains):
        idx = np.array([i for i, d in enumerate(domains) if d == domain and valid[i]], dtype=np.int64)
        if len(idx) < 2:
            continue
        values = scores[idx]
        std = values.std()
        z[idx] = (values - values.mean()) / std if std > 0 else 0.0
    return z


def select_hardest(scores: np.ndarray, domains: list[str], fraction: float, valid: np.ndarray | None = None,
                   seed: int = 0) -> list[int]:
    """Indices of the lowest-scoring `fraction` of each domain, by z-score within the domain: hard
    for the current policy and less prone to reward hacking. Each domain keeps `round(fraction·n)`
    of its `valid` prompts (a prompt whose reward failed has no score and is never "hardest"), at
    least one when `fraction > 0`. Ties (binary rewards tie often) are broken by a random order
    drawn from `seed`, not by position in the file."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    valid = np.ones(len(scores), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    z = domain_zscores(scores, domains, valid)
    tie_break = np.random.default_rng(seed).permutation(len(scores))
    keep: list[int] = []
    for domain in sorted(set(domains)):
        idx = [i for i, d in enumerate(domains) if d == domain and valid[i]]
        n_keep = min(len(idx), max(1 if fraction > 0 else 0, int(math.floor(fraction * len(idx) + 0.5))))
        keep += sorted(idx, key=lambda i: (z[i], tie_break[i]))[:n_keep]
    return sorted(keep)


def curriculum_sources(step: int, stages: list[tuple[int, list[str]]]) -> set[str] | None:
    """The data sources allowed at learner step `step`: the last stage whose start is <= step
    (an empty list = every source). No stage yet, or no stages: everything (None)."""
    allowed: set[str] | None = None
    for start, sources in sorted(stages, key=lambda s: s[0]):
        if step >= start:
            allowed = set(sources) if sources else None
    return allowed


# --- prompt retirement (saturated prompts) ------------------------------------------------------------


def group_outcome(correct: list[bool | None], scores: list[float], failed: list[bool], metric: str = "acc") -> str | None:
    """What a finished group says about its prompt, by DAPO's filter metric: `solved` (every sample
    correct), `unsolved` (every sample wrong), `no_signal` (all equal otherwise: equal scores of a
    reward without a correctness flag), or None (a learning signal; a failed reward: no outcome)."""
    if any(failed) or not correct:
        return None
    if group_has_signal(filter_metric(correct, scores, metric)):
        return None
    if all(c is not None for c in correct) and metric == "acc":
        return "solved" if correct[0] else "unsolved"
    return "no_signal"


def retirement_reason(outcomes: list[str | None], after_groups: int, retire_unsolved: bool = True) -> str | None:
    """Why a prompt is retired from sampling, or None: its last `after_groups` groups all gave the
    same outcome of no signal (`solved`; `unsolved` and `no_signal` only with `retire_unsolved`).
    Such groups carry no gradient under group-relative advantages, so sampling them again is waste."""
    if after_groups <= 0 or len(outcomes) < after_groups:
        return None
    last = outcomes[-after_groups:]
    if last[0] is None or any(v != last[0] for v in last):
        return None
    return last[0] if last[0] == "solved" or retire_unsolved else None
