"""One policy optimisation step over a `TrainBatch`: collation, log-probs, loss, gradient.

Algorithm-blind: advantages arrive with the batch (computed by the assembler with
`asyncrl.algo`); this module sums fixed loss terms (clipped policy loss, optional KL to a
reference, entropy, positive-example NLL) and steps the optimizer. Prompt tokens and
earlier-window context carry no gradient: only `new_token_ids` of each row are scored, and of
those only the tokens whose behaviour distribution the learner can score (`Segment.new_scored`).
On a mixture-of-experts model every forward sees the rollout's routes (`asyncrl.learning.routing`):
replayed with `Objective.router_replay`, measured against the router's own choice either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from asyncrl.algo.losses import (agg_loss, behaviour_weights, kl_penalty, positive_example_nll, ppo_policy_loss,
                                 rollout_mismatch, router_balance_loss)
from asyncrl.config import KLPenalty, PolicyConfig, PolicyLoss, SamplingConfig
from asyncrl.learning.routing import RouteStats, refuse_misfit_routes, replayed_routes, route_metrics, route_shape
from asyncrl.learning.scoring import PolicyForward, token_logprobs
from asyncrl.learning.tensors import (Collated, autocast, clip_and_step, collate, device_of, mini_batch_rows,
                                      rank_micro_batches, row_length, width_of)
from asyncrl.messages.structs import TrainingRow
from asyncrl.weights.sharding import DataParallel

log = logging.getLogger(__name__)


class Objective(msgspec.Struct, frozen=True):
    """What one policy step optimises, as the run's sections give it: the policy learner's section
    (precision resolved, `loss.norm_tokens` set), the sampling distribution the tokens were drawn
    from (the learner scores under the same truncation), the KL loss term and the NLL weight."""

    policy: PolicyConfig
    sampling: SamplingConfig
    kl: KLPenalty  # its coef is 0 when the KL is in the reward (the value learner scores it there)
    nll_coef: float = 0.0
    router_replay: bool = False  # a mixture-of-experts model: the rollout's routes at generated tokens


def _micro_batch_weight(mode: str, mask: torch.Tensor, total_tokens: float, total_seqs: float) -> float:
    """Scale of a micro-batch's aggregated loss so that the weighted sum is the global aggregate."""
    if mode == "token-mean":
        return float(mask.sum()) / total_tokens
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float((mask.sum(-1) > 0).sum()) / total_seqs
    return 1.0


def _routes(collated: Collated, sl) -> torch.Tensor | None:
    return None if collated.routes is None else collated.routes[sl]


def _trained_positions(collated: Collated, sl) -> torch.Tensor:
    return (collated.response_mask[sl] > 0) | (collated.nll_mask[sl] > 0)


def proximal_logprobs(model, collated: Collated, policy: PolicyConfig, sampling: SamplingConfig,
                      parallel: DataParallel | None = None, replay: bool = False) -> torch.Tensor:
    """log π_prox of every trained token: the current weights, before the batch's first update
    (each rank scores its micro-batches; the sum over ranks fills every row)."""
    out = torch.zeros(collated.targets.shape, device=collated.targets.device)
    compute = policy.compute
    with torch.no_grad(), autocast(model, compute.precision):
        for rows, ghost in rank_micro_batches(collated, compute.micro_batch_tokens, parallel):
            sl = (rows, slice(0, width_of(collated.attention_mask, rows)))
            with replayed_routes(model, _routes(collated, sl), replay):
                logp, _ = token_logprobs(model, collated.input_ids[sl], collated.attention_mask[sl],
                                         collated.targets[sl], sampling.temperature,
                                         positions=_trained_positions(collated, sl), top_k=sampling.top_k,
                                         top_p=sampling.top_p, chunk_tokens=compute.logits_chunk_tokens,
                                         images=collated.images_of(rows))
            if not ghost:
                out[sl] = logp.float()
    if parallel is not None:
        parallel.sum_tensor(out)
    return out


@dataclass
class _Update:
    """What every micro-batch of one update reads: the batch, its totals (each micro-batch's loss is
    scaled by the whole batch's), and where the proximal log-probs and the rollout mismatch go."""

    model: object
    collated: Collated
    objective: Objective
    reference_model: object
    proximal: torch.Tensor | None
    correction: tuple[str, float] | None
    own: torch.Tensor | None  # this update's own log-probs, when it is the batch's first (π_prox)
    mismatch: list | None
    total_tokens: float
    total_seqs: float
    norm_constant: float
    total_nll_tokens: float
    route_stats: RouteStats | None = None  # measures the routers (the first pass over the rows)


def _policy_update(model, optimizer, collated: Collated, objective: Objective, reference_model,
                   proximal: torch.Tensor | None, correction: tuple[str, float] | None = None,
                   mismatch: list | None = None, parallel: DataParallel | None = None,
                   route_stats: RouteStats | None = None) -> tuple[dict[str, float], torch.Tensor | None]:
    """One optimizer update over `collated` (micro-batched gradient accumulation). `correction`: the
    behaviour weights' (mode, cap), anchored on `proximal` (log π_prox); with no `proximal`, these
    weights are π_prox (the batch's first update): each micro-batch anchors on its own log-probs,
    returned (every row, summed over the ranks) for the later updates. `mismatch`: where each
    micro-batch's rollout mismatch goes (the first update's forward is at the proximal weights).
    Sharded (`parallel`): each rank accumulates its micro-batches' gradients, each scaled by the
    whole batch's totals, and the ranks' gradients are summed (`asyncrl.weights.sharding`), so the update
    is the one-rank update; the metric sums are summed over the ranks too."""
    loss = objective.policy.loss
    total_nll_tokens = float(collated.nll_mask.sum())
    update = _Update(
        model=model, collated=collated, objective=objective, reference_model=reference_model, proximal=proximal,
        correction=correction, mismatch=mismatch, total_nll_tokens=total_nll_tokens,
        own=None if correction is None or proximal is not None else torch.zeros(collated.targets.shape,
                                                                                device=collated.targets.device),
        total_tokens=max(float(collated.response_mask.sum()), 1.0),
        total_seqs=max(float((collated.response_mask.sum(-1) > 0).sum()), 1.0),
        norm_constant=float(loss.norm_tokens or collated.response_mask.shape[-1]), route_stats=route_stats)
    # Nothing to train (every token masked): the metrics are still computed (every record has the
    # same fields), but no step is taken: an Adam step on zero gradients would still move the
    # weights by its momentum.
    nothing = not float(collated.response_mask.sum()) and not total_nll_tokens
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for rows, ghost in rank_micro_batches(collated, objective.policy.compute.micro_batch_tokens, parallel):
        _micro_batch(update, (rows, slice(0, width_of(collated.attention_mask, rows))), ghost, sums)
    if parallel is not None:
        sums = parallel.sum(sums)
        if update.own is not None:
            parallel.sum_tensor(update.own)
    # The batch's flag, set after the sum over ranks (every rank sees the whole batch: summed, two
    # ranks counted a skipped update twice and the learner's update count fell behind Adam's).
    sums["skipped_updates"] = float(nothing)
    if nothing:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        return {**sums, "grad_norm": 0.0}, update.own
    grad_norm = clip_and_step(model, optimizer, objective.policy.optimizer.grad_clip)
    return {**sums, "grad_norm": float(grad_norm)}, update.own


def _micro_batch(update: _Update, sl, ghost: bool, sums: dict[str, float]) -> None:
    """One micro-batch's forward and backward (gradients accumulate), its metrics added to `sums`
    by its share of the batch's tokens. A ghost runs the collectives and counts for nothing."""
    collated, objective = update.collated, update.objective
    sampling, loss, compute = objective.sampling, objective.policy.loss, objective.policy.compute
    mask = collated.response_mask[sl]
    share = 0.0 if ghost else 1.0
    router_logits = [] if loss.router_aux_coef else None  # the balance loss's, layer by layer
    # Open through the backward: a layer recomputed there (gradient checkpointing) is replayed too.
    with replayed_routes(update.model, _routes(collated, sl), objective.router_replay,
                         None if ghost else update.route_stats, collated.attention_mask[sl] > 0, router_logits):
        with autocast(update.model, compute.precision):
            logp, entropy = token_logprobs(update.model, collated.input_ids[sl], collated.attention_mask[sl],
                                           collated.targets[sl], sampling.temperature, with_entropy=True,
                                           positions=_trained_positions(collated, sl), top_k=sampling.top_k,
                                           top_p=sampling.top_p, chunk_tokens=compute.logits_chunk_tokens,
                                           images=collated.images_of(sl[0]))
        anchor = weights = None
        if update.correction is not None:
            anchor = logp.detach().float() if update.own is not None else update.proximal[sl]
            weights = behaviour_weights(anchor, collated.old_logprobs[sl], mask, *update.correction)
            if update.own is not None and not ghost:
                update.own[sl] = anchor
        pg_loss, metrics = ppo_policy_loss(
            logp, collated.old_logprobs[sl], collated.advantages[sl], mask,
            loss.clip_low, loss.clip_high, loss.dual_clip, loss.agg, update.norm_constant,
            proximal_logp=anchor, behaviour_weight=weights,
        )
        if update.mismatch is not None and not ghost:
            update.mismatch.append((rollout_mismatch(logp.detach(), collated.old_logprobs[sl], mask),
                                    float(mask.sum())))
        total, nll = _loss_terms(pg_loss, metrics, logp, entropy, collated, sl, objective, update.reference_model,
                                 update.norm_constant, update.total_nll_tokens)
        weight = _micro_batch_weight(loss.agg, mask, update.total_tokens, update.total_seqs)
        balance = _balance_term(router_logits, update.model, collated.attention_mask[sl], metrics)
        # The balance loss is a mean over the batch's tokens: each micro-batch adds its share.
        tokens_share = float(mask.sum()) / update.total_tokens
        ((total * weight + objective.nll_coef * nll + loss.router_aux_coef * balance * tokens_share) * share).backward()
    sums["nll_positive"] = sums.get("nll_positive", 0.0) + nll.item() * share
    token_share = float(mask.sum()) / update.total_tokens * share
    metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    metrics["loss"] = total.item()
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + value * token_share


def _balance_term(router_logits: list | None, model, attention_mask: torch.Tensor, metrics: dict) -> torch.Tensor | float:
    """The router balance loss of a micro-batch over its real positions (`metrics` gains
    `router_balance_loss`); 0 when not asked (`policy.loss.router_aux_coef` 0) or for a dense model."""
    if not router_logits:
        return 0.0
    balance = router_balance_loss(router_logits, route_shape(model).top_k, attention_mask.reshape(-1) > 0)
    metrics["router_balance_loss"] = balance.item()
    return balance


def _loss_terms(pg_loss: torch.Tensor, metrics: dict, logp: torch.Tensor, entropy: torch.Tensor, collated: Collated,
                sl, objective: Objective, reference_model, norm_constant: float,
                nll_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's loss: the clipped surrogate, the entropy bonus and the KL to the reference
    (`metrics` gains `kl_ref`); and its VAPO positive-example NLL, already normalised by the batch's
    count of such tokens, so the micro-batch parts simply add up."""
    loss, mask = objective.policy.loss, collated.response_mask[sl]
    total = pg_loss
    if loss.entropy_coef:
        total = total - loss.entropy_coef * agg_loss(entropy, mask, loss.agg, norm_constant)
    if objective.kl.coef and reference_model is not None:
        kl = _reference_kl(reference_model, collated, sl, logp, objective, norm_constant)
        total = total + objective.kl.coef * kl
        metrics["kl_ref"] = kl.item()
    nll = positive_example_nll(logp, collated.nll_mask[sl], torch.ones(len(logp), device=logp.device),
                               normalizer=nll_tokens)
    return total, nll


def _reference_kl(reference_model, collated: Collated, sl, logp: torch.Tensor, objective: Objective,
                  norm_constant: float) -> torch.Tensor:
    """The KL penalty to the frozen reference over micro-batch `sl`'s trained tokens."""
    mask = collated.response_mask[sl]
    sampling = objective.sampling
    with torch.no_grad(), replayed_routes(reference_model, _routes(collated, sl), objective.router_replay):
        ref_logp, _ = token_logprobs(reference_model, collated.input_ids[sl], collated.attention_mask[sl],
                                     collated.targets[sl], sampling.temperature, positions=mask > 0,
                                     top_k=sampling.top_k, top_p=sampling.top_p,
                                     chunk_tokens=objective.policy.compute.logits_chunk_tokens,
                                     images=collated.images_of(sl[0]))
    return agg_loss(kl_penalty(logp, ref_logp, objective.kl.estimator), mask, objective.policy.loss.agg, norm_constant)


def _behaviour_correction(loss: PolicyLoss, updates: int) -> tuple[str, float] | None:
    """The behaviour weights' (mode, cap) a batch trains with: the rollout correction when one is
    set; with several updates and the proximal anchor, the capped ratio proximal/behaviour (tokens
    come from several versions); none otherwise (the clip anchors on the behaviour log-probs)."""
    if loss.rollout_correction != "none":
        return loss.rollout_correction, loss.rollout_is_cap
    if loss.proximal_anchor and updates > 1:
        return "token_tis", loss.behaviour_weight_cap
    return None


def policy_step(model, optimizer, samples: list[TrainingRow], objective: Objective,
                reference_model=None, pad_token_id: int = 0, parallel: DataParallel | None = None) -> dict[str, float]:
    """Train on one batch: `ppo_epochs` passes of `mini_batches` optimizer updates each (one update
    by default). Returns metrics: the updates' mean, the first and last update's clip fraction and
    approximate KL (the trust region at work), and the rollout-training mismatch. `parallel`: this
    rank of a sharded learner (every rank calls it with the whole batch and trains its share)."""
    policy = objective.policy
    vision = model.vision if isinstance(model, PolicyForward) else None
    vision_start = vision.seconds if vision is not None else 0.0
    samples, route_stats, refused = _routed(model, samples)
    # Rows sorted by length, micro-batches trimmed to their longest row: little padding with
    # long-tailed lengths. The loss is a sum over rows, so their order does not change it.
    samples = sorted(samples, key=lambda s: row_length(s.segment))
    collated = collate(samples, pad_token_id).to(device_of(model))
    if not objective.nll_coef:
        collated.nll_mask.zero_()  # no logits wanted at NLL-only positions
    device = collated.input_ids.device
    minis = mini_batch_rows(len(samples), policy.mini_batches)
    correction = _behaviour_correction(policy.loss, policy.ppo_epochs * len(minis))
    # π_prox is the weights before the batch's first update, at which that update's forward runs:
    # its rows anchor on their own log-probs there, and only the other rows are scored beforehand
    # (a forward over half the batch saved with two mini-batches, all of it with one).
    rest = torch.as_tensor([row for rows in minis[1:] for row in rows], dtype=torch.long, device=device)
    proximal = None
    if correction is not None:
        proximal = torch.zeros(collated.targets.shape, device=device)
        if len(rest):
            proximal[rest] = proximal_logprobs(model, collated.select(rest.tolist()), policy, objective.sampling,
                                               parallel, objective.router_replay)
    parts: list = []  # the first update's rollout mismatch, micro-batch by micro-batch
    history = []
    for epoch in range(policy.ppo_epochs):
        for rows in minis:
            index = torch.as_tensor(rows, dtype=torch.long, device=device)
            part = collated if len(minis) == 1 else collated.select(rows)
            first = not history
            prox = None if proximal is None or first else proximal.index_select(0, index)
            metrics, own = _policy_update(model, optimizer, part, objective, reference_model, prox, correction,
                                          parts if first else None, parallel, route_stats if epoch == 0 else None)
            if own is not None:
                proximal.index_copy_(0, index, own)
            history.append(metrics)
    if parallel is not None:
        parts = [p for ps in parallel.gather(parts) for p in ps]
    if proximal is not None and len(rest):  # the other rows' mismatch, at the same weights
        mask = collated.response_mask.index_select(0, rest)
        parts.append((rollout_mismatch(proximal.index_select(0, rest), collated.old_logprobs.index_select(0, rest),
                                       mask), float(mask.sum())))
    metrics = {k: float(np.mean([h.get(k, 0.0) for h in history])) for k in history[0]}
    for key in ("clip_fraction", "approx_kl"):
        metrics[f"{key}_first_update"], metrics[f"{key}_last_update"] = history[0][key], history[-1][key]
    metrics["skipped_updates"] = float(sum(h["skipped_updates"] for h in history))
    return {**metrics, **_combine_mismatch(parts), "policy_updates": policy.ppo_epochs * len(minis),
            "tokens_trained": float(collated.response_mask.sum()), "rows_trained": len(samples),
            **refused, **_route_record(route_stats, parallel),
            **({"vision_s": vision.seconds - vision_start} if vision is not None else {})}


def _routed(model, samples: list[TrainingRow]) -> tuple[list[TrainingRow], RouteStats | None, dict[str, float]]:
    """The rows, those whose routes are not the model's refused (said in the log, counted in
    `router_rows_refused`: they train nothing), and the measure of a mixture-of-experts model's
    routers over the step's first pass over its rows (None for a dense model)."""
    shape = route_shape(model)
    samples, refused = refuse_misfit_routes(samples, shape)
    if refused:
        log.warning("policy learner: %d rows train nothing, their routes are not the model's: %s", len(refused),
                    "; ".join(refused[:3]))
    counts = {"router_rows_refused": float(len(refused))} if shape is not None or refused else {}
    return samples, None if shape is None else RouteStats(shape), counts


def _route_record(stats: RouteStats | None, parallel: DataParallel | None) -> dict[str, float]:
    if stats is None:
        return {}
    sums = stats.sums()
    return route_metrics(parallel.sum(sums) if parallel is not None else sums, stats.shape)


def _combine_mismatch(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    tokens = sum(n for _, n in parts) or 1.0
    return {"rollout_kl_k1": sum(m["rollout_kl_k1"] * n for m, n in parts) / tokens,
            "rollout_kl_k3": sum(m["rollout_kl_k3"] * n for m, n in parts) / tokens,
            "rollout_ratio_max": max((m["rollout_ratio_max"] for m, n in parts if n), default=1.0),
            "rollout_ratio_min": min((m["rollout_ratio_min"] for m, n in parts if n), default=1.0)}
