"""Staleness: how many weight versions a trained token lags the policy it trains. One definition,
used by the prompt source (admission), the assembler (the check) and the learner (the metric).

The bound of a run is `algorithm.max_staleness_versions` (call it S), kept in two ways:
* **Admission** (`admission_budget`): the prompt source issues a prompt only while
  `issued < (learner_version + S + 1) * prompts_per_step + dropped_prompts`, so generators never
  run more than S learner steps ahead of training; dropped work (a group counts 1, a sample 1/G)
  is replaced.
* **The check** (`is_stale`): the assembler drops a group (or a value-based row) any of whose
  trained tokens is more than S versions behind the policy version it knows, when the group
  closes and again when a row batch leaves. Earlier windows of a T-PPO row are context, not
  trained tokens, so they do not count.

A token's staleness is `policy_version - version_that_generated_it`; a row's is that of its oldest
trained token (`new_versions.min()`); a row with no new tokens has staleness 0.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def row_staleness(policy_version: int, new_versions: np.ndarray) -> int:
    """Versions between `policy_version` and the oldest trained token of a row (0 for no tokens)."""
    if not len(new_versions):
        return 0
    return policy_version - int(new_versions.min())


def max_staleness(policy_version: int, rows: Iterable[np.ndarray]) -> int:
    """The staleness of the oldest trained token over several rows (0 for none)."""
    return max((row_staleness(policy_version, v) for v in rows), default=0)


def mean_staleness(policy_version: int, rows: Iterable[np.ndarray]) -> float:
    """Mean row staleness over the rows that have trained tokens (0.0 for none)."""
    values = [row_staleness(policy_version, v) for v in rows if len(v)]
    return sum(values) / len(values) if values else 0.0


def is_stale(policy_version: int, rows: Iterable[np.ndarray], max_staleness_versions: int) -> bool:
    """True when any trained token of `rows` is more than `max_staleness_versions` behind."""
    return max_staleness(policy_version, rows) > max_staleness_versions


def admission_budget(learner_version: int, max_staleness_versions: int, prompts_per_step: int,
                     dropped_prompts: float) -> int:
    """How many prompts may have been issued by now (see the module docstring)."""
    return int((learner_version + max_staleness_versions + 1) * prompts_per_step + dropped_prompts + 1e-9)


def open_prompts_bound(max_staleness_versions: int, prompts_per_step: int) -> int:
    """Prompts that can be open at once under the budget (excluding replaced drops): what the
    prompts mailbox must have room for, or a few stragglers would hold every slot."""
    return (max_staleness_versions + 1) * prompts_per_step
