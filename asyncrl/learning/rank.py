"""One rank's share of the policy's training state: the model (whole, or its FSDP2 shard), the
optimizer and the learning-rate schedule.

The policy learner holds rank 0's and drives the others (`policy.compute.ranks`, each in its own process:
`actors.policy_rank.PolicyRankActor`). Under sharding every method that touches the weights is a collective,
so every rank calls it, in the order rank 0 does; rank 0 alone gets the whole weights back.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import torch

from asyncrl import sharding
from asyncrl.config import AlgorithmConfig, EngineConfig, ModelConfig, PolicyConfig, SamplingConfig
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.rows import build_optimizer
from asyncrl.learning.scoring import PolicyForward
from asyncrl.models import bf16_pays, load_model, load_tokenizer
from asyncrl.schema import TrainSample
from asyncrl.sharding import DataParallel

# The policy's parameters inside `PolicyForward` (the module the optimizer and FSDP see).
PREFIX = "lm."


class PolicyRank:
    def __init__(self, lm, objective: Objective, pad_token_id: int = 0, parallel: DataParallel | None = None):
        self.lm = lm.eval()
        self.objective = objective
        self.pad_token_id = pad_token_id
        self.parallel = parallel
        # A frozen whole copy on every rank (each scores its own micro-batches).
        self.reference = copy.deepcopy(lm).eval().requires_grad_(False) if objective.kl.coef > 0 else None
        self.names = [name for name, _ in lm.named_parameters()]  # what the generators load (tied once)
        self.model = PolicyForward(self.lm).eval()
        if parallel is not None:
            sharding.shard(self.model, self.lm, parallel)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), objective.policy.optimizer)

    def step(self, samples: list[TrainSample]) -> dict[str, float]:
        metrics = policy_step(self.model, self.optimizer, samples, self.objective, self.reference, self.pad_token_id,
                              self.parallel)
        self.scheduler.step()
        return metrics

    def named_parameters(self):
        """(name, parameter) of the policy: whole tensors on one rank, DTensors (global shapes) when
        sharded; for planning transfers, not for reading values."""
        return self.lm.named_parameters()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The parameters by name, a copy: whole on rank 0 (on CPU when sharded), {} on the others."""
        if self.parallel is None:
            return {name: p.detach().clone() for name, p in self.lm.named_parameters()}
        full = sharding.full_weights(self.model, self.parallel)
        return {name: full[PREFIX + name] for name in self.names} if full else {}

    def state(self) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """(weights with buffers by the model's own names, optimizer state by parameter name,
        scheduler state) for a checkpoint: whole on rank 0."""
        full = sharding.full_weights(self.model, self.parallel)
        weights = {name.removeprefix(PREFIX): t for name, t in full.items()}
        return weights, sharding.optimizer_state(self.model, self.optimizer, self.parallel), self.scheduler.state_dict()

    def load(self, weights: dict[str, torch.Tensor], optimizer_state: dict, scheduler_state: dict) -> None:
        """Rank 0 passes what it read; the others pass {} for the weights and the optimizer state
        (sharded: rank 0's are broadcast)."""
        sharding.load_full_weights(self.model, {PREFIX + k: v for k, v in weights.items()}, self.parallel)
        sharding.load_optimizer_state(self.model, self.optimizer, optimizer_state, self.parallel)
        self.scheduler.load_state_dict(scheduler_state)

    def optimizer_steps(self) -> int:
        """Adam's step count of the first parameter (continues across a resume)."""
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0


def build_policy_rank(model: ModelConfig, algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig,
                      sampling: SamplingConfig, seed: int, parallel=None) -> tuple[PolicyRank, Any]:
    """One rank's training state (the model, its objective, the optimizer) and the tokenizer."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model)
    lm = load_model(model, tokenizer)
    if policy.compute.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rank = PolicyRank(lm.to(policy.compute.device), policy_objective(algorithm, policy, engine, sampling, lm),
                      tokenizer.pad_token_id or 0, parallel)
    return rank, tokenizer


def policy_objective(algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig, sampling: SamplingConfig,
                     lm) -> Objective:
    """The run's sections as one policy step reads them: precision resolved for `lm`, the
    Dr.GRPO constant defaulting to the response budget, the KL loss term (none when it is a reward)."""
    compute = msgspec.structs.replace(policy.compute,
                                      precision=learner_precision(policy.compute.precision, lm, policy.compute.device))
    loss = msgspec.structs.replace(policy.loss, norm_tokens=policy.loss.norm_tokens or engine.max_response_tokens)
    return Objective(msgspec.structs.replace(policy, compute=compute, loss=loss), sampling, algorithm.kl_loss,
                     algorithm.nll_coef)


def learner_precision(name: str, model, device: str) -> str:
    """`policy.compute.precision` or `critic.compute.precision` for `model`: auto = bf16 where it pays (`bf16_pays`), else fp32."""
    if name != "auto":
        return name
    return "bf16" if bf16_pays(model, device) else "fp32"


def learner_backend(policy: PolicyConfig) -> str:
    return "nccl" if policy.compute.device == "cuda" else "gloo"
