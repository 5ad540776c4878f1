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

from asyncrl.algo.losses import agg_loss, entropy_from_logits, kl_penalty, positive_example_nll, ppo_policy_loss
from asyncrl.schema import ScoredTrajectory, TrainSample, segment_row


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
    nll_coef: float = 0.0


@dataclass
class Collated:
    """Right-padded rows: context (prompt + earlier windows) then this row's new tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L]: 1 where a position's *next* token is a trained new token
    targets: torch.Tensor  # [B, L]: the next token at each position (0 where not trained)
    old_logprobs: torch.Tensor  # [B, L], behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [B, L]
    nll_mask: torch.Tensor  # [B, L]: trained tokens of finished, correct rows (positive-example NLL)
    positive_rows: torch.Tensor  # [B]: finished and correct (VAPO's positive examples)


@dataclass
class RowLayout:
    """Right-padded token rows `context + new`; row i's new tokens are scored at `slices[i]`
    (the logits/hidden state at position p belong to the token at p+1)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    slices: list[slice]

    def place(self, per_row: list[np.ndarray], dtype=torch.float32) -> torch.Tensor:
        """Scatter one array per row (aligned with its new tokens) into a `[B, L]` tensor."""
        out = torch.zeros(self.input_ids.shape, dtype=dtype)
        for i, (sl, values) in enumerate(zip(self.slices, per_row)):
            out[i, sl] = torch.as_tensor(np.asarray(values), dtype=dtype)
        return out

    def gather(self, full: torch.Tensor) -> list[np.ndarray]:
        return [full[i, sl].detach().float().numpy().copy() for i, sl in enumerate(self.slices)]


def layout_rows(rows: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int = 0) -> RowLayout:
    """`rows` = (context ids, new ids) pairs. A row needs at least one context token."""
    width = max(len(c) + len(n) for c, n in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    slices = []
    for i, (context, new) in enumerate(rows):
        c, n = len(context), len(new)
        if c < 1:
            raise ValueError("a row needs at least one context (prompt) token")
        input_ids[i, :c] = torch.from_numpy(np.asarray(context, dtype=np.int64))
        input_ids[i, c : c + n] = torch.from_numpy(np.asarray(new, dtype=np.int64))
        attention_mask[i, : c + n] = 1
        slices.append(slice(c - 1, c - 1 + n))
    return RowLayout(input_ids, attention_mask, slices)


def collate(samples: list[TrainSample], pad_token_id: int = 0) -> Collated:
    layout = layout_rows([segment_row(s.segment) for s in samples], pad_token_id)
    ones = [np.ones(len(s.segment.new_token_ids), dtype=np.float32) for s in samples]
    loss_masks = [m if s.loss_mask is None else s.loss_mask.astype(np.float32) for s, m in zip(samples, ones)]
    response_mask = layout.place(loss_masks)
    positive = torch.tensor([bool(s.segment.finished and s.correct) for s in samples])
    return Collated(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask,
        response_mask=response_mask,
        targets=layout.place([s.segment.new_token_ids for s in samples], torch.long),
        old_logprobs=layout.place([s.segment.new_logprobs for s in samples]),
        advantages=layout.place([s.advantages for s in samples]),
        nll_mask=response_mask * positive[:, None],
        positive_rows=positive,
    )


def _head_only_on(model) -> bool:
    """The LM head can be applied to selected hidden states only (a plain linear head, no logit
    soft-capping or scaling inside `forward`)."""
    config = model.config
    return (hasattr(model, "lm_head") and hasattr(model, "base_model") and model.base_model is not model
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) is None)


def token_logprobs(model, input_ids, attention_mask, targets, temperature: float, with_entropy: bool = False,
                   positions: torch.Tensor | None = None):
    """log π(target | prefix) at every position under `softmax(logits / T)` (the sampler's
    distribution with top-k/top-p off), and optionally the entropy.

    With `positions` (a `[B, L]` mask of the positions that are trained), the vocabulary projection
    runs only there: prompt and earlier-window positions need hidden states but no logits, and the
    `[tokens, vocab]` logits are most of a step's memory (49k vocabulary on the embedded model).
    Other positions get log-prob 0 and entropy 0."""
    if positions is None or not _head_only_on(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        entropy = entropy_from_logits(logits) if with_entropy else None
        return logp, entropy
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    selected = positions.bool()
    logits = model.lm_head(hidden[selected]).float() / temperature  # [tokens, vocab]
    logp_sel = torch.log_softmax(logits, dim=-1).gather(-1, targets[selected][:, None]).squeeze(-1)
    logp = torch.zeros(targets.shape, dtype=logp_sel.dtype).masked_scatter(selected, logp_sel)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(targets.shape, dtype=logp_sel.dtype).masked_scatter(selected, entropy_from_logits(logits))
    return logp, entropy


def row_length(segment) -> int:
    return len(segment.prompt_token_ids) + len(segment.prior_response_ids) + len(segment.new_token_ids)


def width_of(attention_mask: torch.Tensor, rows: slice) -> int:
    """Columns a micro-batch of right-padded rows needs (its longest row): a batch holding one long
    row would otherwise pad every micro-batch to that length."""
    return int(attention_mask[rows].sum(-1).max())


def micro_batches(collated: Collated, max_tokens: int) -> list[slice]:
    """Contiguous row ranges whose padded token count stays under `max_tokens` (at least one row)."""
    return micro_batches_of(RowLayout(collated.input_ids, collated.attention_mask, []), max_tokens)


def _micro_batch_weight(mode: str, mask: torch.Tensor, total_tokens: float, total_seqs: float) -> float:
    """Scale of a micro-batch's aggregated loss so that the weighted sum is the global aggregate."""
    if mode == "token-mean":
        return float(mask.sum()) / total_tokens
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float((mask.sum(-1) > 0).sum()) / total_seqs
    return 1.0


def clip_and_step(model, optimizer, grad_clip: float) -> torch.Tensor:
    """Clip the gradient norm and step; a non-finite norm skips the step (no NaN reaches the weights)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if math.isfinite(float(grad_norm)):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return grad_norm


def policy_step(model, optimizer, samples: list[TrainSample], settings: PolicyLossSettings,
                reference_model=None, pad_token_id: int = 0) -> dict[str, float]:
    """Forward/backward over micro-batches, clip gradients, step. Returns metrics."""
    # Rows sorted by length, micro-batches trimmed to their longest row: little padding with
    # long-tailed lengths. The loss is a sum over rows, so their order does not change it.
    samples = sorted(samples, key=lambda s: row_length(s.segment))
    collated = collate(samples, pad_token_id)
    total_tokens = max(float(collated.response_mask.sum()), 1.0)
    total_seqs = max(float((collated.response_mask.sum(-1) > 0).sum()), 1.0)
    norm_constant = float(collated.response_mask.sum(-1).max())
    total_nll_tokens = float(collated.nll_mask.sum())
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for rows in micro_batches(collated, settings.micro_batch_tokens):
        sl = (rows, slice(0, width_of(collated.attention_mask, rows)))
        mask = collated.response_mask[sl]
        trained = (mask > 0) | (collated.nll_mask[sl] > 0)
        logp, entropy = token_logprobs(model, collated.input_ids[sl], collated.attention_mask[sl],
                                       collated.targets[sl], settings.temperature, with_entropy=True, positions=trained)
        pg_loss, metrics = ppo_policy_loss(
            logp, collated.old_logprobs[sl], collated.advantages[sl], mask,
            settings.clip_low, settings.clip_high, settings.dual_clip, settings.loss_agg, norm_constant,
        )
        loss = pg_loss
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * agg_loss(entropy, mask, settings.loss_agg, norm_constant)
        # VAPO positive-example LM loss: already normalised by the batch's count of such tokens,
        # so the micro-batch parts simply add up.
        nll = positive_example_nll(logp, mask, collated.positive_rows[rows], normalizer=total_nll_tokens)
        if settings.kl_coef and reference_model is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(reference_model, collated.input_ids[sl], collated.attention_mask[sl],
                                             collated.targets[sl], settings.temperature, positions=trained)
            kl = agg_loss(kl_penalty(logp, ref_logp), mask, settings.loss_agg, norm_constant)
            loss = loss + settings.kl_coef * kl
            metrics["kl_ref"] = kl.item()
        weight = _micro_batch_weight(settings.loss_agg, mask, total_tokens, total_seqs)
        (loss * weight + settings.nll_coef * nll).backward()
        sums["nll_positive"] = sums.get("nll_positive", 0.0) + nll.item()
        token_share = float(mask.sum()) / total_tokens
        metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        metrics["loss"] = loss.item()
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * token_share
    grad_norm = clip_and_step(model, optimizer, settings.grad_clip)
    return {**sums, "grad_norm": float(grad_norm), "tokens_trained": total_tokens, "rows_trained": len(samples)}



# --- the value model --------------------------------------------------------------------------


@dataclass
class ValueLossSettings:
    gamma: float
    lam: float  # critic λ (1.0: Monte-Carlo targets)
    clip_low: float | None
    clip_high: float | None
    grad_clip: float
    micro_batch_tokens: int


def trajectory_rewards(trajectory: ScoredTrajectory) -> np.ndarray:
    """Per-token rewards of a finished response: dense rewards (if any) plus the score on the last token."""
    n = len(trajectory.segment.new_token_ids)
    rewards = np.zeros(n, dtype=np.float32)
    if trajectory.token_rewards is not None:
        m = min(n, len(trajectory.token_rewards))
        rewards[:m] = trajectory.token_rewards[:m]
    if n:
        rewards[-1] += trajectory.score
    return rewards


def predict_values(value_model, rows: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int = 0,
                   max_tokens: int = 4096, with_next: bool = False) -> list[np.ndarray]:
    """`V(s_t)` for each new token of each (context, new) row: the state before the token. With
    `with_next`, one more value per row: the state after its last token."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad():
        start = 0
        while start < len(order):
            # Length-sorted chunks bounded by padded tokens.
            end, longest = start, 0
            while end < len(order):
                length = len(rows[order[end]][0]) + len(rows[order[end]][1])
                if end > start and max(longest, length) * (end - start + 1) > max_tokens:
                    break
                longest = max(longest, length)
                end += 1
            chunk = order[start:end]
            layout = layout_rows([rows[i] for i in chunk], pad_token_id)
            values = value_model(layout.input_ids, layout.attention_mask)
            for j, i in enumerate(chunk):
                sl = layout.slices[j]
                stop = sl.stop + 1 if with_next else sl.stop
                by_index[i] = values[j, sl.start : stop].float().numpy().copy()
            start = end
    return [by_index[i] for i in range(len(rows))]


def value_step(value_model, optimizer, trajectories: list[ScoredTrajectory], settings: ValueLossSettings,
               pad_token_id: int = 0) -> dict[str, float]:
    """One critic update on finished trajectories. Targets are GAE returns with the critic λ over
    the pre-step values (λ=1: Monte-Carlo returns, independent of the values); the loss is the
    clipped value loss around those pre-step values, token-mean over the batch."""
    from asyncrl.algo.advantages import critic_returns
    from asyncrl.algo.losses import value_loss

    if not all(t.segment.finished for t in trajectories):
        raise ValueError("the value model trains on finished trajectories only")
    trajectories = sorted(trajectories, key=lambda t: row_length(t.segment))  # see policy_step
    layout = layout_rows([segment_row(t.segment) for t in trajectories], pad_token_id)
    chunks = [(rows, slice(0, width_of(layout.attention_mask, rows)))
              for rows in micro_batches_of(layout, settings.micro_batch_tokens)]
    mask = layout.place([np.ones(len(t.segment.new_token_ids), dtype=np.float32) for t in trajectories])
    rewards = layout.place([trajectory_rewards(t) for t in trajectories])
    value_model.eval()
    old_values = torch.zeros(mask.shape)
    with torch.no_grad():
        for sl in chunks:
            old_values[sl] = value_model(layout.input_ids[sl], layout.attention_mask[sl]).float()
    old_values = old_values * mask
    # Positions run left to right through context then response; GAE walks only the masked ones.
    returns = critic_returns(rewards, old_values, mask, settings.gamma, settings.lam)
    total_tokens = max(float(mask.sum()), 1.0)
    value_model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"value_loss": 0.0, "value_clip_fraction": 0.0}
    for sl in chunks:
        values = value_model(layout.input_ids[sl], layout.attention_mask[sl])
        loss, metrics = value_loss(values, old_values[sl], returns[sl], mask[sl], settings.clip_low, settings.clip_high)
        share = float(mask[sl].sum()) / total_tokens
        (loss * share).backward()
        sums["value_loss"] += loss.item() * share
        sums["value_clip_fraction"] += metrics["value_clip_fraction"] * share
    grad_norm = clip_and_step(value_model, optimizer, settings.grad_clip)
    m = mask.bool()
    residual = (returns - old_values)[m]
    target_var = returns[m].var(unbiased=False)
    explained = 1.0 - float(residual.var(unbiased=False) / target_var) if float(target_var) > 1e-12 else 0.0
    return {**sums, "value_grad_norm": float(grad_norm), "value_explained_variance": explained,
            "value_mean": float(old_values[m].mean()), "return_mean": float(returns[m].mean()),
            "value_tokens": total_tokens, "value_trajectories": len(trajectories)}


def micro_batches_of(layout: RowLayout, max_tokens: int) -> list[slice]:
    """Contiguous row ranges whose padded token count stays under `max_tokens` (at least one row)."""
    lengths = layout.attention_mask.sum(-1).tolist()
    slices, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and max(longest, length) * (i - start + 1) > max_tokens:
            slices.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, length)
    slices.append(slice(start, len(lengths)))
    return slices
