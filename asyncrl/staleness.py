"""Staleness: how many weight versions a trained token lags the policy it trains. One definition,
used by the prompt source (admission), the assembler (the check) and the learner (the metric).

The bound of a run is `algorithm.max_staleness_versions` (call it S), kept in two ways:
* **Admission** (`admission_budget`): the prompt source issues a prompt only while, with
  `delivered_version` the version every generator holds,
  `issued < (delivered_version + S + 1) * prompts_per_step + dropped_prompts`, so generators never
  run more than S learner steps ahead of training; dropped work (a group counts 1, a sample 1/G)
  is replaced.
* **The bound** (`mask_stale_tokens`): a token more than S versions behind is never trained. The
  learner applies it at the optimizer step, against the version it is training (its own, not a
  copy told to it): that is where the bound holds, whatever waited in which queue. The assembler
  applies the same function once earlier, as a batch leaves it, so that work already too old is
  dropped before it is sent. Stale tokens are masked out of the policy loss
  (loss mask 0), not dropped with their whole group: dropping a group by its oldest token would
  drop long responses (generated over more versions) more often than short ones. A group or row
  with no trainable token left is dropped (reason `stale`). Earlier windows of a T-PPO row are
  context, not trained tokens, so they do not count.

A token's staleness is `weight_version - version_that_generated_it`; a row's is that of its oldest
trained token (loss mask 1); a row with no trained token has staleness 0.
"""

from __future__ import annotations

from typing import Iterable

import msgspec
import numpy as np

from asyncrl.messages.structs import TrainingRow


def row_staleness(weight_version: int, new_versions: np.ndarray) -> int:
    """Versions between `weight_version` and the oldest token of `new_versions` (0 for no tokens)."""
    if not len(new_versions):
        return 0
    return weight_version - int(new_versions.min())


def trained_versions(sample: TrainingRow) -> np.ndarray:
    """The versions of the tokens of `sample` that the policy loss trains (loss mask 1)."""
    versions = sample.segment.new_versions
    return versions if sample.loss_mask is None else versions[sample.loss_mask.astype(bool)]


def mask_stale_tokens(samples: list[TrainingRow], weight_version: int,
                      max_staleness_versions: int) -> tuple[list[TrainingRow], dict[str, float]]:
    """Mask (loss mask 0) every token more than `max_staleness_versions` behind `weight_version`.
    Returns the samples (those unchanged are the same objects) and the stats a batch reports:
    `staleness_max` of the tokens left to train and `stale_tokens_masked`. A sample may end up with
    no trained token; its caller decides whether to keep it (its positive-example NLL tokens, for
    instance, are not policy-loss tokens)."""
    out, masked = [], 0
    for sample in samples:
        versions = sample.segment.new_versions
        stale = (weight_version - versions.astype(np.int64)) > max_staleness_versions
        trained = np.ones(len(versions), dtype=bool) if sample.loss_mask is None else sample.loss_mask.astype(bool)
        newly = stale & trained
        if newly.any():
            masked += int(newly.sum())
            sample = msgspec.structs.replace(sample, loss_mask=(trained & ~stale).astype(np.uint8))
        out.append(sample)
    return out, {"staleness_max": float(max_staleness(weight_version, [trained_versions(t) for t in out])),
                 "stale_tokens_masked": float(masked)}


def has_trained_tokens(sample: TrainingRow) -> bool:
    return bool(len(sample.segment.new_token_ids)) and (sample.loss_mask is None or bool(sample.loss_mask.any()))


def max_staleness(weight_version: int, rows: Iterable[np.ndarray]) -> int:
    """The staleness of the oldest trained token over several rows (0 for none)."""
    return max((row_staleness(weight_version, v) for v in rows), default=0)


def mean_staleness(weight_version: int, rows: Iterable[np.ndarray]) -> float:
    """Mean row staleness over the rows that have trained tokens (0.0 for none)."""
    values = [row_staleness(weight_version, v) for v in rows if len(v)]
    return sum(values) / len(values) if values else 0.0


def admission_budget(delivered_version: int, max_staleness_versions: int, prompts_per_step: int,
                     dropped_prompts: float) -> int:
    """How many prompts may have been issued by now (see the module docstring)."""
    return int((delivered_version + max_staleness_versions + 1) * prompts_per_step + dropped_prompts + 1e-9)


def open_prompts_bound(max_staleness_versions: int, prompts_per_step: int) -> int:
    """Prompts that can be open at once under the budget (excluding replaced drops): what the
    prompts mailbox must have room for, or a few stragglers would hold every slot."""
    return (max_staleness_versions + 1) * prompts_per_step
