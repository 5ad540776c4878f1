"""One rank's share of the policy's training state: the model (whole, or its FSDP2 shard), the
optimizer and the learning-rate schedule.

The policy learner holds rank 0's and drives the others (`policy.ranks`, each in its own process:
`actors.policy_rank.PolicyRankActor`). Under sharding every method that touches the weights is a collective,
so every rank calls it, in the order rank 0 does; rank 0 alone gets the whole weights back.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from typing import Any

from asyncrl import sharding
from asyncrl.config import AlgorithmConfig, EngineConfig, ModelConfig, PolicyConfig
from asyncrl.learning.policy import PolicyLossSettings, loss_settings, policy_step
from asyncrl.learning.rows import adamw
from asyncrl.learning.scoring import PolicyForward
from asyncrl.models import load_model, load_tokenizer
from asyncrl.precision import Precision, choose_precision
from asyncrl.schema import TrainSample
from asyncrl.sharding import DataParallel

# The policy's parameters inside `PolicyForward` (the module the optimizer and FSDP see).
PREFIX = "lm."


class PolicyRank:
    def __init__(self, lm, settings: PolicyLossSettings, lr: float, weight_decay: float, warmup_steps: int = 0,
                 kl_coef: float = 0.0, pad_token_id: int = 0, parallel: DataParallel | None = None):
        self.lm = lm.eval()
        self.settings = settings
        self.precision: Precision | None = None  # how `settings.precision` was chosen (`learner_precision`)
        self.pad_token_id = pad_token_id
        self.parallel = parallel
        # A frozen whole copy on every rank (each scores its own micro-batches).
        self.reference = copy.deepcopy(lm).eval().requires_grad_(False) if kl_coef > 0 else None
        self.names = [name for name, _ in lm.named_parameters()]  # what the generators load (tied once)
        self.model = PolicyForward(self.lm).eval()
        if parallel is not None:
            sharding.shard(self.model, self.lm, parallel)
        self.optimizer = adamw(self.model.parameters(), lr, weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0)

    def step(self, samples: list[TrainSample]) -> dict[str, float]:
        metrics = policy_step(self.model, self.optimizer, samples, self.settings, self.reference, self.pad_token_id,
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
                      seed: int, parallel=None) -> tuple[PolicyRank, Any]:
    """One rank's training state (the model, its loss settings, the optimizer) and the tokenizer."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model)
    lm = load_model(model, tokenizer)
    if policy.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kl_coef = 0.0 if algorithm.kl_in_reward else algorithm.kl_coef  # in the reward: the value learner scores it
    settings = loss_settings(algorithm, policy, engine)
    precision = learner_precision(policy.precision, lm, policy.device, "policy learner", parallel)
    settings = dataclasses.replace(settings, precision=precision.name)
    rank = PolicyRank(lm.to(policy.device), settings, policy.lr, policy.weight_decay,
                      policy.warmup_steps, kl_coef, tokenizer.pad_token_id or 0, parallel)
    rank.precision = precision
    return rank, tokenizer


# A learner's matmuls have a micro-batch of rows (thousands of tokens); their speed in either dtype
# levels off well below that, and fewer rows keep the probe short.
LEARNER_PROBE_ROWS = 256


def learner_precision(name: str, model, device: str, role: str, parallel: DataParallel | None = None) -> Precision:
    """`policy.precision` or `critic.precision` for `model` (`asyncrl.precision.choose_precision`
    at `LEARNER_PROBE_ROWS` rows). The ranks of a sharded learner decide on their timings summed,
    so all take the same."""
    combine = None if parallel is None else (lambda fp32_s, bf16_s: tuple(
        parallel.sum({"fp32": fp32_s, "bf16": bf16_s})[k] for k in ("fp32", "bf16")))
    return choose_precision(name, model, device, LEARNER_PROBE_ROWS, role, combine)


def learner_backend(policy: PolicyConfig) -> str:
    return "nccl" if policy.device == "cuda" else "gloo"
