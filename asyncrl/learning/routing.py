"""Routing replay (R3) in the learners' forward: a mixture-of-experts model's generated tokens go
through the experts the rollout used, and the router's own choice is measured against them.

The learners run transformers' models, whose sparse blocks (`Qwen3MoeSparseMoeBlock`,
`Qwen2MoeSparseMoeBlock`, `MixtralSparseMoeBlock`: a module with a router `gate` and `experts`)
call their router once per forward: `gate(hidden) -> (router_logits, weights, ids)`.
`replayed_routes` hooks every router for as long as it is open (a forward and its backward:
gradient checkpointing runs the forward again there). Where a position holds a recorded route, the
ids are replaced by it and the weights recomputed from the current router logits at those ids: the
softmax over every expert in float32, gathered at the replayed ids, renormalised over them where
the family does and rounded to the hidden dtype where the family does (the engine's rules,
`asyncrl.engines.moe.MoeMLP`). The selection is the rollout's; the weights, and the router's
gradient through them, are the learner's own.

A token's route sits at the position its log-prob is scored at (`asyncrl.messages.routes`); prompt
positions and tokens without a recorded route are routed by the learner. `RouteStats` measures, on
the forwards it is given, the share of recorded (token, sparse layer) routes whose top-k set the
router would have chosen otherwise (`router_mismatch`, replay on or off) and the experts' load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from asyncrl.engines import moe
from asyncrl.messages.routes import routed_tokens
from asyncrl.messages.structs import TrainingRow, response_routes


@dataclass(frozen=True)
class RouteShape:
    """What a model's routes are: sparse layers, experts chosen per token, experts per layer."""

    layers: int
    top_k: int
    experts: int

    def refusal(self, routes: np.ndarray) -> str | None:
        """Why `routes` (`[tokens, layers, top_k]`) are not this model's (one phrase), or None."""
        if routes.shape[1:] != (self.layers, self.top_k):
            return (f"routes of {routes.shape[1]} sparse layers x top-{routes.shape[2]}, but the model has "
                    f"{self.layers} x top-{self.top_k}")
        recorded = routes[routed_tokens(routes)]
        if recorded.size and int(recorded.max()) >= self.experts:
            return f"expert id {int(recorded.max())} of a model with {self.experts} experts"
        return None


# transformers' routers whose forward is `gate(hidden) -> (router_logits, weights, ids)`, a softmax
# top-k: the families routing replay knows (those of `asyncrl.engines.moe`).
ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def sparse_blocks(model) -> list[torch.nn.Module]:
    """transformers' sparse MoE blocks of `model` (a router of `ROUTERS` and experts), in layer order."""
    return [m for m in model.modules() if type(getattr(m, "gate", None)).__name__ in ROUTERS and hasattr(m, "experts")]


def route_shape(model) -> RouteShape | None:
    """The routes a model takes (None: a dense model)."""
    blocks = sparse_blocks(model)
    if not blocks:
        return None
    gate = blocks[0].gate
    return RouteShape(len(blocks), int(gate.top_k), int(gate.num_experts))


def replay_on(setting: str, model) -> bool:
    """`model.router_replay` for this model: `auto` and `rollout` replay a mixture-of-experts
    model's routes, `off` never; `rollout` on a dense model is refused, naming its family (the
    config's check reads a model directory's family before anything starts; this one the model)."""
    from asyncrl.config import ConfigError

    sparse = route_shape(model) is not None
    if setting == "rollout" and not sparse:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        kind = (f"a {family} model whose routers it does not know (Mixtral, Qwen2-MoE, Qwen3-MoE)"
                if any(hasattr(m, "experts") for m in model.modules()) else f"a dense {family} model")
        raise ConfigError(f"model.router_replay=rollout replays a mixture-of-experts model's routes, but the model is "
                          f"{kind}: set model.router_replay=auto or off")
    return setting != "off" and sparse


def misfit_reason(row: TrainingRow, shape: RouteShape | None) -> str | None:
    """Why a row's recorded routes are not the model's (one phrase), or None: it has none, or they fit."""
    routes = response_routes(row.segment)
    return None if routes is None else ("a dense model" if shape is None else shape.refusal(routes))


def refuse_misfit_routes(rows: list[TrainingRow], shape: RouteShape | None) -> tuple[list[TrainingRow], list[str]]:
    """Rows whose routes are not the model's (another model's record) train nothing: their loss
    mask is zeroed and their routes dropped, never replayed. The rows, and why each was refused."""
    out, reasons = [], []
    for row in rows:
        reason = misfit_reason(row, shape)
        if reason is None:
            out.append(row)
            continue
        reasons.append(f"sample {row.segment.sample_id}: {reason}")
        segment = msgspec.structs.replace(row.segment, new_routes=None, prior_routes=None)
        out.append(msgspec.structs.replace(row, segment=segment,
                                           loss_mask=np.zeros(len(segment.new_token_ids), dtype=np.uint8)))
    return out, reasons


class RouteStats:
    """Sums over the forwards of a step (kept on the model's device until read): recorded (token,
    layer) routes compared and those whose top-k set the router chose otherwise, and the (token,
    slot) assignments of each expert of each sparse layer over the real positions."""

    def __init__(self, shape: RouteShape):
        self.shape = shape
        self.compared = self.differ = 0
        self.load: torch.Tensor | None = None  # [layers, experts]

    def add(self, layer: int, own: torch.Tensor, recorded: torch.Tensor | None, used: torch.Tensor,
            valid: torch.Tensor | None) -> None:
        """One sparse layer of one forward: `own` `[T, k]` the router's choice, `recorded` the
        rollout's (-1: none), `used` the ids the experts ran, `valid` `[T]` the real positions."""
        if recorded is not None:
            known = (recorded >= 0).all(-1) if valid is None else (recorded >= 0).all(-1) & valid
            same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)
            self.compared = self.compared + known.sum()
            self.differ = self.differ + (known & ~same).sum()
        if self.load is None:
            self.load = torch.zeros((self.shape.layers, self.shape.experts), dtype=torch.float64, device=own.device)
        ids = used if valid is None else used[valid]
        self.load[layer] += torch.bincount(ids.reshape(-1), minlength=self.shape.experts).double()

    def sums(self) -> dict[str, float]:
        """The sums as numbers by name (what the ranks of a sharded learner add up)."""
        load = self.load.cpu().reshape(-1).tolist() if self.load is not None else [0.0] * (
            self.shape.layers * self.shape.experts)
        return {"router_compared": float(self.compared), "router_differ": float(self.differ),
                **{f"expert_load/{i}": v for i, v in enumerate(load)}}


def route_metrics(sums: dict[str, float], shape: RouteShape) -> dict[str, float]:
    """A step record's fields from `RouteStats.sums` (summed over the ranks): `router_mismatch`, the
    share of recorded routes the router would have chosen otherwise; `router_replayable`, how many
    (token, layer) routes were recorded; the experts' load in (token, slot) assignments per expert
    per sparse layer: its max, its mean, and their ratio (1: balanced)."""
    load = np.array([sums[f"expert_load/{i}"] for i in range(shape.layers * shape.experts)])
    mean = float(load.mean()) if load.size else 0.0
    return {"router_mismatch": sums["router_differ"] / max(sums["router_compared"], 1.0),
            "router_replayable": sums["router_compared"], "expert_load_max": float(load.max(initial=0.0)),
            "expert_load_mean": mean, "expert_load_max_over_mean": float(load.max(initial=0.0)) / mean if mean else 0.0}


@contextlib.contextmanager
def replayed_routes(model, routes: torch.Tensor | None, replay: bool, stats: RouteStats | None = None,
                    valid: torch.Tensor | None = None, router_logits: list | None = None):
    """While open, every router of `model` (a transformers MoE model, or a module holding one) sees
    `routes` `[B, L, sparse_layers, top_k]` (-1: none recorded) for its forward's `[B, L]` positions:
    with `replay` it uses them where recorded (see the module's docstring); `stats` measures the
    first forward of each layer (a recomputation in the backward is not counted twice) over the
    positions `valid` (`[B, L]` bool, the attention mask); `router_logits` gains each layer's `[B*L,
    E]` router logits of the first forward, with their graph (the balance loss). A dense model, or
    nothing asked: no hook."""
    blocks = sparse_blocks(model)
    if not blocks or (stats is None and router_logits is None and (routes is None or not replay)):
        yield
        return
    config = next(m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_experts_per_tok"))
    rules = moe.MoeMLP(config)
    flat_valid = None if valid is None else valid.reshape(-1).bool()
    counted: set[int] = set()

    def hook_of(layer: int):
        def hook(gate, args, output):
            logits, weights, own = output
            recorded = None if routes is None else routes[:, :, layer].reshape(-1, routes.shape[-1]).long()
            ids = own
            if replay and recorded is not None:
                ids = torch.where((recorded >= 0).all(-1, keepdim=True), recorded, own)
            if layer not in counted:  # a first forward (not a recomputation in the backward)
                counted.add(layer)
                if stats is not None:
                    stats.add(layer, own, recorded, ids, flat_valid)
                if router_logits is not None:
                    router_logits.append(logits)
            if ids is own:
                return None
            chosen = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
            if rules.normalise:
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            return logits, chosen if rules.float_weights else chosen.to(logits.dtype), ids
        return hook

    handles = [block.gate.register_forward_hook(hook_of(i)) for i, block in enumerate(blocks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
