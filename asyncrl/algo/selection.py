"""Prompt selection and curriculum (Data-scaling RLHF, arXiv 2503.22230 §"Pre-PPO"; ALGORITHMS.md §8).

Pure functions over per-prompt scores and domains (a prompt's `data_source`).
"""

from __future__ import annotations

import math

import numpy as np


def domain_zscores(scores: np.ndarray, domains: list[str]) -> np.ndarray:
    """Scores standardised within each domain (score distributions differ by domain). A domain with
    one prompt or zero spread gets z = 0."""
    scores = np.asarray(scores, dtype=np.float64)
    z = np.zeros_like(scores)
    for domain in set(domains):
        idx = np.array([i for i, d in enumerate(domains) if d == domain])
        values = scores[idx]
        std = values.std()
        z[idx] = (values - values.mean()) / std if len(idx) > 1 and std > 0 else 0.0
    return z


def select_hardest(scores: np.ndarray, domains: list[str], fraction: float) -> list[int]:
    """Indices of the lowest-scoring `fraction` of each domain (ties broken by index), by z-score
    within the domain: hard for the current policy and less prone to reward hacking. Each domain
    keeps `round(fraction·n)` prompts, at least one when `fraction > 0`."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    z = domain_zscores(scores, domains)
    keep: list[int] = []
    for domain in sorted(set(domains)):
        idx = [i for i, d in enumerate(domains) if d == domain]
        n_keep = min(len(idx), max(1 if fraction > 0 else 0, int(math.floor(fraction * len(idx) + 0.5))))
        keep += sorted(idx, key=lambda i: (z[i], i))[:n_keep]
    return sorted(keep)


def curriculum_sources(step: int, stages: list[tuple[int, list[str]]]) -> set[str] | None:
    """The data sources allowed at learner step `step`: the last stage whose start is <= step
    (an empty list = every source). No stage yet, or no stages: everything (None)."""
    allowed: set[str] | None = None
    for start, sources in sorted(stages, key=lambda s: s[0]):
        if step >= start:
            allowed = set(sources) if sources else None
    return allowed
