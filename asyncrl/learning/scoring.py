"""How the learners score tokens: log π(token | prefix) under the sampler's own distribution
(temperature, top-k, top-p: the same `filtered_logprobs` as the sampler), computed only at the
positions that are trained, optionally a chunk of the vocabulary projection at a time.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.checkpoint

from asyncrl.algo.losses import entropy_from_logprobs
from asyncrl.algo.sampling import filtered_logprobs
from asyncrl.learning.routing import replayed_routes
from asyncrl.learning.tensors import device_of, layout_rows, length_sorted_chunks, row_routes
from asyncrl.models.vision import VisionInputs, image_token_ids, is_vision_model, vision_kwargs, without_image_tokens


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
    forward (calling `base_model` and then `lm_head` on the bare model would bypass them). A
    vision-language model's rows may have images (`images`: each row's processed references): the
    vision tower runs once per distinct image of the forward (`asyncrl.models.vision.VisionInputs`)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.vision = VisionInputs(lm) if is_vision_model(lm) else None
        self.banned = image_token_ids(lm) if self.vision is not None else None  # as the engine samples

    def forward(self, input_ids, attention_mask, selected: torch.Tensor | None = None, score=None,
                chunk_tokens: int = 0, images: list[tuple[str, ...]] | None = None):
        """`score(logits, start)`: what the caller wants of the logits of the selected positions
        `start:start + len(logits)` (a tuple of `[n]` tensors); with it the head runs `chunk_tokens`
        positions at a time, each chunk recomputed in the backward instead of kept (the `[tokens,
        vocab]` logits, their softmax and the entropy's terms, several copies of the vocabulary per
        trained position), and the parts are joined."""
        extra = vision_kwargs(self.vision, input_ids, images, self.lm)
        if selected is None:
            return self._head_out(self.lm(input_ids=input_ids, attention_mask=attention_mask, **extra).logits)
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                    **extra).last_hidden_state[selected]
        if score is None:
            return self._head_out(self.lm.lm_head(hidden))
        step = chunk_tokens if chunk_tokens > 0 else max(len(hidden), 1)
        recompute = chunk_tokens > 0 and torch.is_grad_enabled()  # no backward, nothing kept: no recompute

        def chunk(h, i):
            return score(self._head_out(self.lm.lm_head(h)), i)

        parts = [torch.utils.checkpoint.checkpoint(chunk, hidden[i:i + step], i, use_reentrant=False,
                                                   preserve_rng_state=False) if recompute
                 else chunk(hidden[i:i + step], i)
                 for i in range(0, max(len(hidden), 1), step)]  # one (empty) part when nothing is selected
        return tuple(torch.cat(outs) for outs in zip(*parts))

    def _head_out(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits a token is scored from: a vision-language model's without its image tokens."""
        return logits if self.banned is None else without_image_tokens(logits, self.banned)


def token_logprobs(model, input_ids, attention_mask, targets, temperature: float, with_entropy: bool = False,
                   positions: torch.Tensor | None = None, top_k: int = 0, top_p: float = 1.0,
                   chunk_tokens: int = 0, images: list[tuple[str, ...]] | None = None):
    """log π(target | prefix) at every position under the sampler's distribution: `softmax(logits/T)`
    restricted to `top_k`/`top_p` as `asyncrl.algo.sampling.filtered_logprobs` does (a token outside
    it gets `LOGPROB_FLOOR`), and optionally the entropy of that distribution.

    With `positions` (a `[B, L]` mask of the positions that are trained), the vocabulary projection
    runs only there: prompt and earlier-window positions need hidden states but no logits, and each
    `[tokens, vocab]` tensor is 200 KB per position on the embedded model (49k vocabulary, fp32).
    Other positions get log-prob 0 and entropy 0. `chunk_tokens` (with `positions`): project that
    many positions at a time, recomputing each chunk in the backward (`PolicyForward.forward`).
    `model`: a causal LM or its `PolicyForward`; `images`: each row's processed images (a
    vision-language model's rows)."""
    forward = model if isinstance(model, PolicyForward) else PolicyForward(model)
    if positions is None or not _head_only_on(forward.lm):
        logits = forward(input_ids, attention_mask, images=images)
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

    scored = forward(input_ids, attention_mask, selected, score=score, chunk_tokens=chunk_tokens, images=images)
    logp = torch.zeros(targets.shape, dtype=scored[0].dtype, device=targets.device).masked_scatter(selected, scored[0])
    entropy = None
    if with_entropy:
        entropy = torch.zeros(targets.shape, dtype=scored[1].dtype, device=targets.device).masked_scatter(
            selected, scored[1])
    return logp, entropy


def response_logprobs(model, rows: list[tuple], temperature: float, top_k: int = 0, top_p: float = 1.0,
                      pad_token_id: int = 0, max_tokens: int = 4096, replay: bool = False,
                      images: list[tuple[str, ...]] | None = None) -> list[np.ndarray]:
    """log π(new token | context) for each new token of each (context, new) row, under the sampling
    distribution (`token_logprobs`): e.g. the reference policy's for a KL penalty. `replay`: a
    row's routes (`routed_row`'s third item) are replayed on a mixture-of-experts model; `images`:
    each row's processed images (a vision-language model's rows)."""
    by_index: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for chunk in length_sorted_chunks(rows, max_tokens):
            layout = layout_rows([rows[i] for i in chunk], pad_token_id, device_of(model))
            new = [rows[i][1] for i in chunk]
            targets = layout.place(new, torch.long)
            positions = layout.place([np.ones(len(n), dtype=np.float32) for n in new]) > 0
            with replayed_routes(model, row_routes(layout, [rows[i] for i in chunk]), replay):
                logp, _ = token_logprobs(model, layout.input_ids, layout.attention_mask, targets, temperature,
                                         positions=positions, top_k=top_k, top_p=top_p,
                                         images=None if images is None else [images[i] for i in chunk])
            for j, i in enumerate(chunk):
                by_index[i] = logp[j, layout.slices[j]].float().cpu().numpy().copy()
    return [by_index[i] for i in range(len(rows))]

