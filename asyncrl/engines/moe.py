"""The sparse (mixture-of-experts) MLP of the engine's own decoder, and the routes it records or replays.

Three families: Mixtral, Qwen2-MoE (with a shared expert behind a sigmoid gate) and Qwen3-MoE.
Their attention is the dense families' (`asyncrl.engines.llama_decoder`); a sparse layer's MLP is
a router (linear -> softmax over the experts in float32 -> top-k) and the experts the router
chose, each token's outputs weighted by its router probabilities at the chosen experts. Mixtral
always renormalises those top-k weights and keeps them in float32; Qwen2-MoE and Qwen3-MoE
renormalise only with `norm_topk_prob` and round them to the hidden dtype first (transformers'
routers of these families). Layers that are not sparse (`mlp_only_layers`, `decoder_sparse_step`)
keep the dense MLP and are the decoder's.

Experts run grouped: the (token, slot) pairs are sorted by expert, each expert's tokens go through
one matmul pair, and the weighted outputs are written back to their pairs and summed per token
(a sum in a fixed order, not an atomic scatter-add: the same tokens give the same bits, which
routing replay relies on). transformers' default `grouped_mm` experts do the same arithmetic. The
weights are read from the model's own expert parameters at every call, so updates are seen as they
land; the fused 3-D layout (`gate_up_proj` `[experts, 2 * intermediate, hidden]`, `down_proj`
`[experts, hidden, intermediate]`) is the one this transformers version has, and `unsupported`
names any other.

Routing replay: a `Routes` passed to the decoder's forward records the top-k expert ids each
position chose at each sparse layer, or forces given ids; forced ids are weighted by the router's
own probabilities at those ids, renormalised as the family does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def is_sparse(layer) -> bool:
    """Whether this decoder layer's MLP is a router over experts (not a dense MLP)."""
    return hasattr(layer.mlp, "experts")


def unsupported(model) -> str | None:
    """Why `MoeMLP` cannot compute this MoE model's sparse layers (one phrase), or None."""
    for layer in model.model.layers:
        if not is_sparse(layer):
            continue
        experts = layer.mlp.experts
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
                and gate_up.dim() == 3 and down.dim() == 3):
            return f"experts of {type(experts).__name__} are not fused 3-D gate_up_proj/down_proj"
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            return "expert weights are transposed or interleave gate and up"
        if getattr(experts, "has_bias", False):
            return "experts have biases"
    return None


class Routes:
    """The routing of one decoder forward, when asked: `forced`, ids `[b, S, sparse_layers, top_k]`
    to use instead of the router's choice (None: the router chooses); after the forward, `chosen`
    holds the ids used, int16 `[b, S, sparse_layers, top_k]` (per row: tokens x layers x top-k)."""

    def __init__(self, forced: torch.Tensor | None = None):
        self.forced = forced
        self.chosen: torch.Tensor | None = None
        self._layers: list[torch.Tensor] = []

    def forced_at(self, sparse_index: int) -> torch.Tensor | None:
        if self.forced is None:
            return None
        return self.forced[:, :, sparse_index].reshape(-1, self.forced.shape[-1]).long()

    def record(self, ids: torch.Tensor, batch: int, width: int) -> None:
        self._layers.append(ids.view(batch, width, -1))

    def finish(self) -> None:
        self.chosen = torch.stack(self._layers, dim=2).to(torch.int16)
        self._layers = []


class MoeMLP:
    """A sparse layer's MLP for one family (the rules of its config)."""

    def __init__(self, config):
        self.top_k = int(config.num_experts_per_tok)
        mixtral = config.model_type == "mixtral"
        self.normalise = mixtral or bool(getattr(config, "norm_topk_prob", False))
        # Mixtral's router hands its experts float32 weights; the Qwen routers round them to the hidden dtype.
        self.float_weights = mixtral

    def __call__(self, mlp, x: torch.Tensor, forced: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[T, hidden]` (normalised): the MLP's output `[T, hidden]` and the expert ids used `[T, top_k]`."""
        ids, weights = self.route(mlp.gate.weight, x, forced)
        out = grouped_experts(mlp.experts, x, ids, weights)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE: a dense expert every token takes, scaled by a sigmoid gate
            dense = shared.down_proj(F.silu(shared.gate_proj(x)) * shared.up_proj(x))
            out = out + torch.sigmoid(mlp.shared_expert_gate(x)) * dense
        return out, ids

    def route(self, router_weight: torch.Tensor, x: torch.Tensor, forced: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids `[T, top_k]` (the router's top-k, or `forced`) and their weights."""
        probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
        if forced is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            ids, weights = forced, probs.gather(-1, forced)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.float_weights else weights.to(x.dtype)


def grouped_experts(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum over each token's experts of weight x expert(token), `[T, hidden]`: the (token, slot)
    pairs grouped by expert, one matmul pair per expert that has tokens."""
    tokens, top_k = ids.shape
    expert_of_pair, order = torch.sort(ids.reshape(-1), stable=True)
    grouped = x[order // top_k]
    counts = torch.bincount(expert_of_pair, minlength=experts.gate_up_proj.shape[0]).tolist()  # one sync
    outputs = torch.empty((tokens * top_k, x.shape[-1]), dtype=torch.promote_types(x.dtype, weights.dtype),
                          device=x.device)
    pair_weights = weights.reshape(-1)[order]
    first = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(first, first + count)
        gate, up = F.linear(grouped[rows], experts.gate_up_proj[expert]).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, experts.down_proj[expert])
        # Written back to the pairs' own places: the per-token sum below has a fixed order.
        outputs[order[rows]] = out * pair_weights[rows, None]
        first += count
    return outputs.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
