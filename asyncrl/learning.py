"""One policy optimisation step over a `TrainBatch`: collation, log-probs, loss, gradient.

Algorithm-blind: advantages arrive with the batch (computed by the assembler with
`asyncrl.algo`); this module sums fixed loss terms (clipped policy loss, optional KL to a
reference) and steps the optimizer. Prompt tokens and earlier-window context carry no gradient:
only `new_token_ids` of each row are scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.algo.losses import agg_loss, entropy_from_logits, kl_penalty, ppo_policy_loss
from asyncrl.schema import TrainSample


@dataclass
class PolicyLossSettings:
    clip_low: float
    clip_high: float
    dual_clip: float | None
    loss_agg: str
    kl_coef: float
    entropy_coef: float
    temperature: float
    grad_clip: float
    micro_batch_tokens: int


@dataclass
class Collated:
    """Right-padded rows: context (prompt + earlier windows) then this row's new tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L]: 1 where a position's *next* token is a trained new token
    targets: torch.Tensor  # [B, L]: the next token at each position (0 where not trained)
    old_logprobs: torch.Tensor  # [B, L], behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [B, L]


def collate(samples: list[TrainSample], pad_token_id: int = 0) -> Collated:
    rows = []
    for s in samples:
        seg = s.segment
        context = np.concatenate([seg.prompt_token_ids, seg.prior_response_ids]).astype(np.int64)
        rows.append((context, seg.new_token_ids.astype(np.int64), seg.new_logprobs, s.advantages))
    width = max(len(c) + len(n) for c, n, _, _ in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, width))
    targets = torch.zeros((batch, width), dtype=torch.long)
    old_logprobs = torch.zeros((batch, width))
    advantages = torch.zeros((batch, width))
    for i, (context, new, logprobs, adv) in enumerate(rows):
        c, n = len(context), len(new)
        input_ids[i, :c] = torch.from_numpy(context)
        input_ids[i, c : c + n] = torch.from_numpy(new)
        attention_mask[i, : c + n] = 1
        # The logits at position p predict token p+1: new token j sits at c+j, predicted at c+j-1.
        sl = slice(c - 1, c - 1 + n)
        response_mask[i, sl] = 1.0
        targets[i, sl] = torch.from_numpy(new)
        old_logprobs[i, sl] = torch.from_numpy(np.asarray(logprobs, dtype=np.float32))
        advantages[i, sl] = torch.from_numpy(np.asarray(adv, dtype=np.float32))
    return Collated(input_ids, attention_mask, response_mask, targets, old_logprobs, advantages)


def token_logprobs(model, input_ids, attention_mask, targets, temperature: float, with_entropy: bool = False):
    """log π(target | prefix) at every position under `softmax(logits / T)` (the sampler's
    distribution with top-k/top-p off), and optionally the entropy."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logp, entropy


def micro_batches(collated: Collated, max_tokens: int) -> list[slice]:
    """Contiguous row ranges whose padded token count stays under `max_tokens` (at least one row)."""
    lengths = collated.attention_mask.sum(-1).tolist()
    slices, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        longest_if_added = max(longest, length)
        if i > start and longest_if_added * (i - start + 1) > max_tokens:
            slices.append(slice(start, i))
            start, longest_if_added = i, length
        longest = longest_if_added
    slices.append(slice(start, len(lengths)))
    return slices


def _micro_batch_weight(mode: str, mask: torch.Tensor, total_tokens: float, total_seqs: float) -> float:
    """Scale of a micro-batch's aggregated loss so that the weighted sum is the global aggregate."""
    if mode == "token-mean":
        return float(mask.sum()) / total_tokens
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float((mask.sum(-1) > 0).sum()) / total_seqs
    return 1.0


def policy_step(model, optimizer, samples: list[TrainSample], settings: PolicyLossSettings,
                reference_model=None, pad_token_id: int = 0) -> dict[str, float]:
    """Forward/backward over micro-batches, clip gradients, step. Returns metrics."""
    collated = collate(samples, pad_token_id)
    total_tokens = float(collated.response_mask.sum())
    total_seqs = float((collated.response_mask.sum(-1) > 0).sum())
    norm_constant = float(collated.response_mask.sum(-1).max())
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for sl in micro_batches(collated, settings.micro_batch_tokens):
        mask = collated.response_mask[sl]
        logp, entropy = token_logprobs(model, collated.input_ids[sl], collated.attention_mask[sl],
                                       collated.targets[sl], settings.temperature, with_entropy=True)
        pg_loss, metrics = ppo_policy_loss(
            logp, collated.old_logprobs[sl], collated.advantages[sl], mask,
            settings.clip_low, settings.clip_high, settings.dual_clip, settings.loss_agg, norm_constant,
        )
        loss = pg_loss
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * agg_loss(entropy, mask, settings.loss_agg, norm_constant)
        if settings.kl_coef and reference_model is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(reference_model, collated.input_ids[sl], collated.attention_mask[sl],
                                             collated.targets[sl], settings.temperature)
            kl = agg_loss(kl_penalty(logp, ref_logp), mask, settings.loss_agg, norm_constant)
            loss = loss + settings.kl_coef * kl
            metrics["kl_ref"] = float(kl)
        weight = _micro_batch_weight(settings.loss_agg, mask, total_tokens, total_seqs)
        (loss * weight).backward()
        token_share = float(mask.sum()) / total_tokens
        metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        metrics["loss"] = float(loss)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * token_share
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    if math.isfinite(float(grad_norm)):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {**sums, "grad_norm": float(grad_norm), "tokens_trained": total_tokens, "samples_trained": len(samples)}

