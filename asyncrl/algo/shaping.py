"""Reward shaping and sample filters of DAPO (arXiv 2503.14476, ALGORITHMS.md §5)."""

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


def group_has_signal(scores: torch.Tensor) -> bool:
    """DAPO dynamic sampling keeps a group if its rewards are not all equal (or it has one member)."""
    return scores.numel() == 1 or bool((scores != scores[0]).any())
