"""One policy optimisation step over a `TrainBatch`: collation, log-probs, loss, gradient.

Algorithm-blind: advantages arrive with the batch (computed by the assembler with
`asyncrl.algo`); this module sums fixed loss terms (clipped policy loss, optional KL to a
reference) and steps the optimizer. Prompt tokens and earlier-window context carry no gradient:
only `new_token_ids` of each row are scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.utils.checkpoint

from asyncrl.algo.losses import (agg_loss, behaviour_weights, entropy_from_logprobs, kl_penalty, positive_example_nll,
                                 ppo_policy_loss, rollout_mismatch)
from asyncrl.algo.sampling import filtered_logprobs
from asyncrl.algo.shaping import is_positive
from asyncrl.engines.base import long_tail_min_tokens
from asyncrl.schema import ScoredTrajectory, TrainSample, segment_row
from asyncrl.sharding import DataParallel, parts_of_rank


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
    norm_constant: float | None = None
    """Divisor of `seq-mean-token-sum-norm`: a fixed length (the run passes the response budget), so
    the loss scale does not move with the batch's longest row."""
    ppo_epochs: int = 1
    mini_batches: int = 1
    """Each batch is trained `ppo_epochs` times in `mini_batches` optimizer updates (DAPO/VAPO:
    many updates per rollout step, so the clip acts as a trust region)."""
    proximal_anchor: bool = True
    """With more than one update per batch, clip around the proximal policy (the learner's weights
    before the batch's first update; decoupled PPO, AReaL) and weight each token by the capped
    importance ratio proximal/behaviour: tokens come from several versions."""
    behaviour_weight_cap: float = 5.0
    rollout_correction: str = "none"
    """Rollout-training mismatch correction (`asyncrl.algo.losses.behaviour_weights`): when set, the
    proximal log-probs are recomputed every batch and weight the loss with cap `rollout_is_cap`."""
    rollout_is_cap: float = 2.0
    precision: str = "fp32"
    """bf16: forward and backward under bf16 autocast (the weights and Adam's state stay fp32)."""
    kl_estimator: str = "low_var_kl"
    # The sampling distribution of the generators, so the learner scores the distribution the
    # tokens were drawn from (the same `filtered_logprobs` as the sampler).
    top_k: int = 0
    top_p: float = 1.0
    mask_first_token: bool = False
    """FIRE: the first response token was drawn at the hot temperature, a distribution the learner
    does not score: it carries no policy loss."""
    long_tail: tuple[float, int] = (0.0, 0)
    """The long-tail benchmark workload holds EOS back before `long_tail_min_tokens`: those
    positions carry no policy loss (their behaviour distribution excluded EOS)."""
    logits_chunk_tokens: int = 0
    """Project the vocabulary this many trained positions at a time, each chunk recomputed in the
    backward (0: all at once, kept for the backward)."""


@dataclass
class Collated:
    """Right-padded rows: context (prompt + earlier windows) then this row's new tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L]: 1 where a position's *next* token is a trained new token
    targets: torch.Tensor  # [B, L]: the next token at each position (0 where not trained)
    old_logprobs: torch.Tensor  # [B, L], behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [B, L]
    nll_mask: torch.Tensor  # [B, L]: every new token of finished, positive rows (positive-example NLL)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.response_mask, self.targets, self.old_logprobs,
                self.advantages, self.nll_mask)

    def select(self, rows: list[int]) -> "Collated":
        index = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        return Collated(*(t.index_select(0, index) for t in self._tensors()))

    def to(self, device: torch.device | str) -> "Collated":
        return Collated(*(t.to(device) for t in self._tensors()))


@dataclass
class RowLayout:
    """Right-padded token rows `context + new`; row i's new tokens are scored at `slices[i]`
    (the logits/hidden state at position p belong to the token at p+1)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    slices: list[slice]

    def place(self, per_row: list[np.ndarray], dtype=torch.float32) -> torch.Tensor:
        """Scatter one array per row (aligned with its new tokens) into a `[B, L]` tensor (on the
        layout's device)."""
        out = torch.zeros(self.input_ids.shape, dtype=dtype)
        for i, (sl, values) in enumerate(zip(self.slices, per_row)):
            out[i, sl] = torch.as_tensor(np.asarray(values), dtype=dtype)
        return out.to(self.input_ids.device)

    def gather(self, full: torch.Tensor) -> list[np.ndarray]:
        return [full[i, sl].detach().float().cpu().numpy().copy() for i, sl in enumerate(self.slices)]


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def layout_rows(rows: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int = 0, device="cpu") -> RowLayout:
    """`rows` = (context ids, new ids) pairs, as tensors on `device`. A row needs at least one
    context token."""
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
    return RowLayout(input_ids.to(device), attention_mask.to(device), slices)


def behaviour_differs(segment, settings: PolicyLossSettings | None) -> np.ndarray:
    """Bool per new token: its behaviour distribution is one the learner does not score (FIRE's
    hot first token; positions where the long-tail workload held EOS back)."""
    n = len(segment.new_token_ids)
    positions = len(segment.prior_response_ids) + np.arange(n)
    differs = np.zeros(n, dtype=bool)
    if settings is None:
        return differs
    if settings.mask_first_token:
        differs |= positions == 0
    held = long_tail_min_tokens(segment.seed, *settings.long_tail)
    if held:
        differs |= positions < held
    return differs


def collate(samples: list[TrainSample], pad_token_id: int = 0, settings: PolicyLossSettings | None = None) -> Collated:
    layout = layout_rows([segment_row(s.segment) for s in samples], pad_token_id)
    ones = [np.ones(len(s.segment.new_token_ids), dtype=np.float32) for s in samples]
    loss_masks = [(m if s.loss_mask is None else s.loss_mask.astype(np.float32)) * ~behaviour_differs(s.segment, settings)
                  for s, m in zip(samples, ones)]
    positive = [float(s.segment.finished and is_positive(s.correct, s.score)) for s in samples]
    return Collated(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask,
        response_mask=layout.place(loss_masks),
        targets=layout.place([s.segment.new_token_ids for s in samples], torch.long),
        old_logprobs=layout.place([s.segment.new_logprobs for s in samples]),
        advantages=layout.place([s.advantages for s in samples]),
        nll_mask=layout.place([m * p for m, p in zip(ones, positive)]),
    )


def _head_only_on(model) -> bool:
    """The LM head can be applied to selected hidden states only (a plain linear head, no logit
    soft-capping or scaling inside `forward`)."""
    config = model.config
    return (hasattr(model, "lm_head") and hasattr(model, "base_model") and model.base_model is not model
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) is None)


# Log-prob given to a token outside the truncated (top-k/top-p) distribution: finite, so masks and
# ratios stay NaN-free; the ratio clamp (±20) then makes such a token carry no gradient.
LOGPROB_FLOOR = -1e4


def _scored_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    if top_k or top_p < 1.0:
        return filtered_logprobs(logits, temperature, top_k, top_p)  # the sampler's own function
    return torch.log_softmax(logits.float() / temperature, dim=-1)


class PolicyForward(torch.nn.Module):
    """A causal LM's forward as one module: logits at every position, or (`selected`, a `[B, L]`
    bool mask) at the selected positions only. The learner trains through it: a sharded learner
    (FSDP2) wraps it whole, so the root's hooks that gather the embedding and the head run on every
    forward (calling `base_model` and then `lm_head` on the bare model would bypass them)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, selected: torch.Tensor | None = None, score=None,
                chunk_tokens: int = 0):
        """`score(logits, start)`: what the caller wants of the logits of the selected positions
        `start:start + len(logits)` (a tuple of `[n]` tensors); with it the head runs `chunk_tokens`
        positions at a time, each chunk recomputed in the backward instead of kept (the `[tokens,
        vocab]` logits, their softmax and the entropy's terms, several copies of the vocabulary per
        trained position), and the parts are joined."""
        if selected is None:
            return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[selected]
        if score is None:
            return self.lm.lm_head(hidden)
        step = chunk_tokens if chunk_tokens > 0 else max(len(hidden), 1)
        recompute = chunk_tokens > 0 and torch.is_grad_enabled()  # no backward, nothing kept: no recompute

        def chunk(h, i):
            return score(self.lm.lm_head(h), i)

        parts = [torch.utils.checkpoint.checkpoint(chunk, hidden[i:i + step], i, use_reentrant=False,
                                                   preserve_rng_state=False) if recompute
                 else chunk(hidden[i:i + step], i)
                 for i in range(0, max(len(hidden), 1), step)]  # one (empty) part when nothing is selected
        return tuple(torch.cat(outs) for outs in zip(*parts))


def token_logprobs(model, input_ids, attention_mask, targets, temperature: float, with_entropy: bool = False,
                   positions: torch.Tensor | None = None, top_k: int = 0, top_p: float = 1.0,
                   chunk_tokens: int = 0):
    """log π(target | prefix) at every position under the sampler's distribution: `softmax(logits/T)`
    restricted to `top_k`/`top_p` as `asyncrl.algo.sampling.filtered_logprobs` does (a token outside
    it gets `LOGPROB_FLOOR`), and optionally the entropy of that distribution.

    With `positions` (a `[B, L]` mask of the positions that are trained), the vocabulary projection
    runs only there: prompt and earlier-window positions need hidden states but no logits, and each
    `[tokens, vocab]` tensor is 200 KB per position on the embedded model (49k vocabulary, fp32).
    Other positions get log-prob 0 and entropy 0. `chunk_tokens` (with `positions`): project that
    many positions at a time, recomputing each chunk in the backward (`PolicyForward.forward`).
    `model`: a causal LM or its `PolicyForward`."""
    forward = model if isinstance(model, PolicyForward) else PolicyForward(model)
    if positions is None or not _head_only_on(forward.lm):
        logits = forward(input_ids, attention_mask)
        all_logp = _scored_logprobs(logits, temperature, top_k, top_p)
        logp = all_logp.gather(-1, targets[..., None]).squeeze(-1).clamp(min=LOGPROB_FLOOR)
        entropy = entropy_from_logprobs(all_logp) if with_entropy else None
        return logp, entropy
    selected = positions.bool()
    selected_targets = targets[selected]

    def score(logits, start):  # [n, vocab] -> the targets' log-probs (and the entropies) of positions start..
        all_logp = _scored_logprobs(logits, temperature, top_k, top_p)
        logp = all_logp.gather(-1, selected_targets[start:start + len(logits), None]).squeeze(-1)
        return (logp.clamp(min=LOGPROB_FLOOR), *((entropy_from_logprobs(all_logp),) if with_entropy else ()))

    scored = forward(input_ids, attention_mask, selected, score=score, chunk_tokens=chunk_tokens)
    logp = torch.zeros(targets.shape, dtype=scored[0].dtype, device=targets.device).masked_scatter(selected, scored[0])
    entropy = None
    if with_entropy:
        entropy = torch.zeros(targets.shape, dtype=scored[1].dtype, device=targets.device).masked_scatter(
            selected, scored[1])
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


def rank_micro_batches(collated: Collated, max_tokens: int, parallel: DataParallel | None) -> list[tuple[slice, bool]]:
    """This rank's micro-batches of `collated` as (rows, ghost): all of them on one rank; dealt
    round-robin over the ranks of a sharded learner, each rank getting as many (a ghost, weighted
    0, evens a short share: every rank runs the same number of forwards and backwards, as FSDP's
    collectives require)."""
    parts = micro_batches(collated, max_tokens)
    return parts_of_rank(parts, parallel)


def mini_batch_rows(n_rows: int, mini_batches: int) -> list[list[int]]:
    """Rows (sorted by length) dealt round-robin into `mini_batches` updates: each update gets a
    spread of lengths and stays sorted, so its micro-batches pad little."""
    k = max(1, min(mini_batches, n_rows))
    return [list(range(i, n_rows, k)) for i in range(k)]


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
    if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    if math.isfinite(float(grad_norm)):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return grad_norm


def _trained_positions(collated: Collated, sl) -> torch.Tensor:
    return (collated.response_mask[sl] > 0) | (collated.nll_mask[sl] > 0)


def autocast(model, precision: str):
    """bf16 autocast on the model's device (fp32 master weights: only the matmuls run in bf16)."""
    return torch.autocast(device_type=device_of(model).type, dtype=torch.bfloat16, enabled=precision == "bf16")


def proximal_logprobs(model, collated: Collated, settings: PolicyLossSettings,
                      parallel: DataParallel | None = None) -> torch.Tensor:
    """log π_prox of every trained token: the current weights, before the batch's first update
    (each rank scores its micro-batches; the sum over ranks fills every row)."""
    out = torch.zeros(collated.targets.shape, device=collated.targets.device)
    with torch.no_grad(), autocast(model, settings.precision):
        for rows, ghost in rank_micro_batches(collated, settings.micro_batch_tokens, parallel):
            sl = (rows, slice(0, width_of(collated.attention_mask, rows)))
            logp, _ = token_logprobs(model, collated.input_ids[sl], collated.attention_mask[sl], collated.targets[sl],
                                     settings.temperature, positions=_trained_positions(collated, sl),
                                     top_k=settings.top_k, top_p=settings.top_p, chunk_tokens=settings.logits_chunk_tokens)
            if not ghost:
                out[sl] = logp.float()
    if parallel is not None:
        parallel.sum_tensor(out)
    return out


def _policy_update(model, optimizer, collated: Collated, settings: PolicyLossSettings, reference_model,
                   proximal: torch.Tensor | None, weights: torch.Tensor | None = None,
                   mismatch: list | None = None, parallel: DataParallel | None = None) -> dict[str, float]:
    """One optimizer update over `collated` (micro-batched gradient accumulation). `weights`: the
    behaviour correction per token; `mismatch`: where each micro-batch's rollout mismatch goes (the
    first update, whose forward is at the weights the behaviour log-probs are compared with).
    Sharded (`parallel`): each rank accumulates its micro-batches' gradients, each scaled by the
    whole batch's totals, and the ranks' gradients are summed (`asyncrl.sharding`), so the update
    is the one-rank update; the metric sums are summed over the ranks too."""
    total_tokens = max(float(collated.response_mask.sum()), 1.0)
    total_seqs = max(float((collated.response_mask.sum(-1) > 0).sum()), 1.0)
    norm_constant = settings.norm_constant or float(collated.response_mask.shape[-1])
    total_nll_tokens = float(collated.nll_mask.sum())
    # Nothing to train (every token masked): the metrics are still computed (every record has the
    # same fields), but no step is taken: an Adam step on zero gradients would still move the
    # weights by its momentum.
    nothing = not float(collated.response_mask.sum()) and not total_nll_tokens
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for rows, ghost in rank_micro_batches(collated, settings.micro_batch_tokens, parallel):
        sl = (rows, slice(0, width_of(collated.attention_mask, rows)))
        mask = collated.response_mask[sl]
        share = 0.0 if ghost else 1.0  # a ghost runs the collectives and counts for nothing
        with autocast(model, settings.precision):
            logp, entropy = token_logprobs(model, collated.input_ids[sl], collated.attention_mask[sl],
                                           collated.targets[sl], settings.temperature, with_entropy=True,
                                           positions=_trained_positions(collated, sl), top_k=settings.top_k,
                                           top_p=settings.top_p, chunk_tokens=settings.logits_chunk_tokens)
        pg_loss, metrics = ppo_policy_loss(
            logp, collated.old_logprobs[sl], collated.advantages[sl], mask,
            settings.clip_low, settings.clip_high, settings.dual_clip, settings.loss_agg, norm_constant,
            proximal_logp=None if proximal is None else proximal[sl], behaviour_weight=None if weights is None else weights[sl],
        )
        if mismatch is not None and not ghost:
            mismatch.append((rollout_mismatch(logp.detach(), collated.old_logprobs[sl], mask), float(mask.sum())))
        loss = pg_loss
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * agg_loss(entropy, mask, settings.loss_agg, norm_constant)
        # VAPO positive-example LM loss: already normalised by the batch's count of such tokens,
        # so the micro-batch parts simply add up.
        nll = positive_example_nll(logp, collated.nll_mask[sl], torch.ones(len(logp), device=logp.device),
                                   normalizer=total_nll_tokens)
        if settings.kl_coef and reference_model is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(reference_model, collated.input_ids[sl], collated.attention_mask[sl],
                                             collated.targets[sl], settings.temperature, positions=mask > 0,
                                             top_k=settings.top_k, top_p=settings.top_p,
                                             chunk_tokens=settings.logits_chunk_tokens)
            kl = agg_loss(kl_penalty(logp, ref_logp, settings.kl_estimator), mask, settings.loss_agg, norm_constant)
            loss = loss + settings.kl_coef * kl
            metrics["kl_ref"] = kl.item()
        weight = _micro_batch_weight(settings.loss_agg, mask, total_tokens, total_seqs)
        ((loss * weight + settings.nll_coef * nll) * share).backward()
        sums["nll_positive"] = sums.get("nll_positive", 0.0) + nll.item() * share
        token_share = float(mask.sum()) / total_tokens * share
        metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        metrics["loss"] = loss.item()
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * token_share
    if parallel is not None:
        sums = parallel.sum(sums)
    # The batch's flag, set after the sum over ranks (every rank sees the whole batch: summed, two
    # ranks counted a skipped update twice and the learner's update count fell behind Adam's).
    sums["skipped_updates"] = float(nothing)
    if nothing:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        return {**sums, "grad_norm": 0.0}
    grad_norm = clip_and_step(model, optimizer, settings.grad_clip)
    return {**sums, "grad_norm": float(grad_norm)}


def policy_step(model, optimizer, samples: list[TrainSample], settings: PolicyLossSettings,
                reference_model=None, pad_token_id: int = 0, parallel: DataParallel | None = None) -> dict[str, float]:
    """Train on one batch: `ppo_epochs` passes of `mini_batches` optimizer updates each (one update
    by default). Returns metrics: the updates' mean, the first and last update's clip fraction and
    approximate KL (the trust region at work), and the rollout-training mismatch. `parallel`: this
    rank of a sharded learner (every rank calls it with the whole batch and trains its share)."""
    # Rows sorted by length, micro-batches trimmed to their longest row: little padding with
    # long-tailed lengths. The loss is a sum over rows, so their order does not change it.
    samples = sorted(samples, key=lambda s: row_length(s.segment))
    collated = collate(samples, pad_token_id, settings).to(device_of(model))
    if not settings.nll_coef:
        collated.nll_mask.zero_()  # no logits wanted at NLL-only positions
    minis = mini_batch_rows(len(samples), settings.mini_batches)
    updates = settings.ppo_epochs * len(minis)
    correcting = settings.rollout_correction != "none"
    proximal = weights = None
    if correcting or (settings.proximal_anchor and updates > 1):
        proximal = proximal_logprobs(model, collated, settings, parallel)
        mode, cap = ((settings.rollout_correction, settings.rollout_is_cap) if correcting
                     else ("token_tis", settings.behaviour_weight_cap))
        weights = behaviour_weights(proximal, collated.old_logprobs, collated.response_mask, mode, cap)
        mismatch = rollout_mismatch(proximal, collated.old_logprobs, collated.response_mask)
    parts: list = []
    history = []
    for _ in range(settings.ppo_epochs):
        for rows in minis:
            index = torch.as_tensor(rows, device=collated.input_ids.device)
            part = collated if len(minis) == 1 else collated.select(rows)
            prox = None if proximal is None else (proximal if len(minis) == 1 else proximal.index_select(0, index))
            w = None if weights is None else (weights if len(minis) == 1 else weights.index_select(0, index))
            history.append(_policy_update(model, optimizer, part, settings, reference_model, prox, w,
                                          parts if proximal is None and not history else None, parallel))
    if proximal is None:  # measured in the first update's forward, at the same weights
        mismatch = _combine_mismatch(parts if parallel is None else [p for ps in parallel.gather(parts) for p in ps])
    metrics = {k: float(np.mean([h.get(k, 0.0) for h in history])) for k in history[0]}
    for key in ("clip_fraction", "approx_kl"):
        metrics[f"{key}_first_update"], metrics[f"{key}_last_update"] = history[0][key], history[-1][key]
    metrics["skipped_updates"] = float(sum(h["skipped_updates"] for h in history))
    return {**metrics, **mismatch, "policy_updates": updates, "tokens_trained": float(collated.response_mask.sum()),
            "rows_trained": len(samples)}


def _combine_mismatch(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    tokens = sum(n for _, n in parts) or 1.0
    return {"rollout_kl_k1": sum(m["rollout_kl_k1"] * n for m, n in parts) / tokens,
            "rollout_kl_k3": sum(m["rollout_kl_k3"] * n for m, n in parts) / tokens,
            "rollout_ratio_max": max((m["rollout_ratio_max"] for m, n in parts if n), default=1.0),
            "rollout_ratio_min": min((m["rollout_ratio_min"] for m, n in parts if n), default=1.0)}


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


def length_sorted_chunks(rows: list[tuple[np.ndarray, np.ndarray]], max_tokens: int) -> Iterator[list[int]]:
    """Indices of `rows` (context, new) in length order, in chunks whose padded token count stays
    under `max_tokens` (at least one row each): inference over many rows with little padding."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    start = 0
    while start < len(order):
        end, longest = start, 0
        while end < len(order):
            length = len(rows[order[end]][0]) + len(rows[order[end]][1])
            if end > start and max(longest, length) * (end - start + 1) > max_tokens:
                break
            longest = max(longest, length)
            end += 1
        yield order[start:end]
        start = end


def predict_values(value_model, rows: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int = 0,
                   max_tokens: int = 4096, with_next: bool = False) -> list[np.ndarray]:
    """`V(s_t)` for each new token of each (context, new) row: the state before the token. With
    `with_next`, one more value per row: the state after its last token."""
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for chunk in length_sorted_chunks(rows, max_tokens):
            layout = layout_rows([rows[i] for i in chunk], pad_token_id, device_of(value_model))
            values = value_model(layout.input_ids, layout.attention_mask).float().cpu()
            for j, i in enumerate(chunk):
                sl = layout.slices[j]
                stop = sl.stop + 1 if with_next else sl.stop
                by_index[i] = values[j, sl.start : stop].numpy().copy()
    return [by_index[i] for i in range(len(rows))]


def response_logprobs(model, rows: list[tuple[np.ndarray, np.ndarray]], temperature: float, top_k: int = 0,
                      top_p: float = 1.0, pad_token_id: int = 0, max_tokens: int = 4096) -> list[np.ndarray]:
    """log π(new token | context) for each new token of each (context, new) row, under the sampling
    distribution (`token_logprobs`): e.g. the reference policy's for a KL penalty."""
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for chunk in length_sorted_chunks(rows, max_tokens):
            layout = layout_rows([rows[i] for i in chunk], pad_token_id, device_of(model))
            new = [rows[i][1] for i in chunk]
            targets = layout.place(new, torch.long)
            positions = layout.place([np.ones(len(n), dtype=np.float32) for n in new]) > 0
            logp, _ = token_logprobs(model, layout.input_ids, layout.attention_mask, targets, temperature,
                                     positions=positions, top_k=top_k, top_p=top_p)
            for j, i in enumerate(chunk):
                by_index[i] = logp[j, layout.slices[j]].float().cpu().numpy().copy()
    return [by_index[i] for i in range(len(rows))]


def value_step(value_model, optimizer, trajectories: list[ScoredTrajectory], settings: ValueLossSettings,
               pad_token_id: int = 0) -> dict[str, float]:
    """One critic update on finished trajectories. Targets are GAE returns with the critic λ (λ=1:
    Monte-Carlo returns, independent of the values); the loss is the clipped value loss around the
    values recorded when each trajectory was valued for its advantages (the PPO recipe: the clip
    bounds how far the critic moves from the values the policy was trained with). A trajectory
    without recorded values (valued never: warm-up) is anchored at the pre-step values, where the
    clip cannot act. Token-mean over the batch."""
    from asyncrl.algo.advantages import critic_returns
    from asyncrl.algo.losses import value_loss

    if not all(t.segment.finished for t in trajectories):
        raise ValueError("the value model trains on finished trajectories only")
    trajectories = sorted(trajectories, key=lambda t: row_length(t.segment))  # see policy_step
    layout = layout_rows([segment_row(t.segment) for t in trajectories], pad_token_id, device_of(value_model))
    chunks = [(rows, slice(0, width_of(layout.attention_mask, rows)))
              for rows in micro_batches_of(layout, settings.micro_batch_tokens)]
    mask = layout.place([np.ones(len(t.segment.new_token_ids), dtype=np.float32) for t in trajectories])
    rewards = layout.place([trajectory_rewards(t) for t in trajectories])
    value_model.eval()
    old_values = torch.zeros(mask.shape, device=mask.device)
    with torch.no_grad():
        for sl in chunks:
            old_values[sl] = value_model(layout.input_ids[sl], layout.attention_mask[sl]).float()
    recorded = torch.tensor([t.values is not None for t in trajectories], device=mask.device)
    if bool(recorded.any()):
        placed = layout.place([t.values if t.values is not None else np.zeros(len(t.segment.new_token_ids))
                               for t in trajectories])
        old_values = torch.where(recorded[:, None], placed, old_values)
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
            "value_tokens": total_tokens, "value_trajectories": len(trajectories),
            "value_anchor_recorded_fraction": float(recorded.float().mean())}


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
