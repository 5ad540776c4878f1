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

from asyncrl.config import AlgorithmConfig, EngineConfig, ModelConfig, PolicyConfig, SamplingConfig
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.routing import replay_on
from asyncrl.learning.scoring import PolicyForward
from asyncrl.learning.tensors import build_optimizer
from asyncrl.messages.structs import TrainingRow
from asyncrl.models.loading import load_model, load_tokenizer
from asyncrl.models.precision import Precision, choose_precision
from asyncrl.models.vision import freeze_vision_tower, is_vision_model
from asyncrl.storage import checkpoint, checkpoint_parts
from asyncrl.weights import lora, lora_experts, sharding
from asyncrl.weights.sharding import DataParallel
from asyncrl.weights.sync import AdapterSpec

# The policy's parameters inside `PolicyForward` (the module the optimizer and FSDP see).
PREFIX = "lm."


class PolicyRank:
    """`peft_model`: LoRA's `PeftModel` around `lm` (`asyncrl.weights.lora.wrap`; `model_config` its settings):
    the optimizer then holds the adapter only, the generators receive it alone (`delivered`), a
    checkpoint keeps it alone, and `snapshot` is the merged weights."""

    def __init__(self, lm, objective: Objective, pad_token_id: int = 0, parallel: DataParallel | None = None,
                 peft_model=None, model_config: ModelConfig | None = None):
        self.lm = lm.eval()
        self.peft_model, self.model_config = peft_model, model_config
        self.adapter = (AdapterSpec(model_config.lora_rank, model_config.lora_alpha) if peft_model is not None
                        else None)
        # peft's expert wrappers -> the parameters they adapt: the names generators and plain models know.
        self.experts = lora_experts.wrapped_parameters(lm) if peft_model is not None else {}
        self.objective = objective
        self.precision: Precision | None = None  # how `objective`'s precision was chosen (`learner_precision`)
        self.pad_token_id = pad_token_id
        self.parallel = parallel
        # A frozen whole copy on every rank (each scores its own micro-batches).
        self.reference = copy.deepcopy(lm).eval().requires_grad_(False) if objective.kl.coef > 0 else None
        self.names = [name for name, _ in lm.named_parameters()]  # what the generators load (tied once)
        self.model = PolicyForward(self.lm).eval()
        if parallel is not None:
            sharding.shard(self.model, self.lm, parallel)
        self.optimizer, self.scheduler = build_optimizer([p for p in self.model.parameters() if p.requires_grad],
                                                         objective.policy.optimizer)

    def step(self, samples: list[TrainingRow]) -> dict[str, float]:
        metrics = policy_step(self.model, self.optimizer, samples, self.objective, self.reference, self.pad_token_id,
                              self.parallel)
        self.scheduler.step()
        return metrics

    def named_parameters(self):
        """(name, parameter) of the policy: whole tensors on one rank, DTensors (global shapes) when
        sharded; for planning transfers, not for reading values."""
        return self.lm.named_parameters()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The parameters by name, a copy: whole on rank 0 (on CPU when sharded), {} on the others.
        With LoRA, a plain model's weights (the adapter merged)."""
        if self.parallel is None:
            state = {name: p.detach() for name, p in self.lm.named_parameters()}
        else:
            full = sharding.full_weights(self.model, self.parallel)
            state = {name: full[PREFIX + name] for name in self.names} if full else {}
        if self.adapter is not None:
            return lora.merged_weights(state, self.adapter.scaling, self.experts) if state else {}
        return {name: t.clone() for name, t in state.items()} if self.parallel is None else state

    def delivered_parameters(self):
        """(name, tensor) of what the generators receive, live (for planning transfers and the shm
        path): every parameter, or with LoRA the adapter (`asyncrl.weights.lora.adapter_tensors`)."""
        named = self.lm.named_parameters()
        return named if self.adapter is None else lora.adapter_tensors(named, self.experts)

    def delivered(self) -> dict[str, torch.Tensor]:
        """A copy of what the generators receive (whole on rank 0, {} on the others): every
        parameter, or with LoRA the adapter alone."""
        if self.adapter is None:
            return self.snapshot()
        if self.parallel is None:
            return {name: t.detach().clone() for name, t in self.delivered_parameters()}
        full = sharding.full_weights(self.model, self.parallel)
        return dict(lora.adapter_tensors(((name.removeprefix(PREFIX), t) for name, t in full.items()), self.experts))

    def state(self) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """(weights with buffers by the model's own names, optimizer state by parameter name,
        scheduler state) for a checkpoint: whole on rank 0."""
        full = sharding.full_weights(self.model, self.parallel)
        weights = {name.removeprefix(PREFIX): t for name, t in full.items()
                   if self.adapter is None or lora.is_adapter(name)}  # LoRA: the adapter alone
        return weights, sharding.optimizer_state(self.model, self.optimizer, self.parallel), self.scheduler.state_dict()

    def save_policy(self, directory: str, weights: dict[str, torch.Tensor], tokenizer) -> None:
        """The policy part of a checkpoint from `state()`'s weights: a Hugging Face directory, or with
        LoRA the adapter in peft's format (`asyncrl.weights.lora.save_adapter`)."""
        if self.adapter is None:
            checkpoint_parts.save_policy(self.lm, tokenizer, directory, state_dict=weights)
        else:
            lora.save_adapter(directory, self.peft_model, weights, self.model_config, tokenizer)

    def read_policy(self, directory: str) -> dict[str, torch.Tensor]:
        """The weights a checkpoint's policy part holds, checked against this rank's model."""
        if self.adapter is None:
            return checkpoint_parts.read_policy_weights(self.lm, directory)
        if not lora.is_adapter_dir(directory):
            raise checkpoint.CorruptCheckpoint(f"{directory}: model.lora_rank={self.adapter.rank}, but this "
                                               f"checkpoint holds no LoRA adapter (a full fine-tune's?)")
        weights = lora.read_adapter(directory)
        expected = {name for name, _ in self.lm.named_parameters() if lora.is_adapter(name)}
        if set(weights) != expected or any(weights[n].shape != p.shape for n, p in self.lm.named_parameters()
                                           if n in weights):
            raise checkpoint.CorruptCheckpoint(f"{directory}: the adapter does not fit model.lora_rank="
                                               f"{self.adapter.rank}, model.target_modules={self.model_config.target_modules}")
        return weights

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
    if is_vision_model(lm) and model.freeze_vision_tower:
        freeze_vision_tower(lm)
    if policy.compute.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    precision = learner_precision(policy.compute.precision, lm, policy.compute.device, "policy learner", parallel)
    peft_model = lora.wrap(lm, model) if model.lora_rank else None
    objective = policy_objective(algorithm, policy, engine, sampling, lm, precision, model.router_replay)
    rank = PolicyRank(lm.to(policy.compute.device), objective, tokenizer.pad_token_id or 0, parallel, peft_model, model)
    rank.precision = precision
    return rank, tokenizer


def policy_objective(algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig, sampling: SamplingConfig,
                     lm, precision: Precision | None = None, router_replay: str = "auto") -> Objective:
    """The run's sections as one policy step reads them: precision resolved for `lm` (`precision`,
    else chosen here), the Dr.GRPO constant defaulting to the response budget, the KL loss term
    (none when it is a reward), routing replay on a mixture-of-experts `lm` (`model.router_replay`)."""
    if precision is None:
        precision = learner_precision(policy.compute.precision, lm, policy.compute.device, "policy learner")
    compute = msgspec.structs.replace(policy.compute, precision=precision.name)
    loss = msgspec.structs.replace(policy.loss, norm_tokens=policy.loss.norm_tokens or engine.max_response_tokens)
    return Objective(msgspec.structs.replace(policy, compute=compute, loss=loss), sampling, algorithm.kl_loss,
                     algorithm.nll_coef, replay_on(router_replay, lm))


# A learner's matmuls have a micro-batch of rows (thousands of tokens); their speed in either dtype
# levels off well below that, and fewer rows keep the probe short.
LEARNER_PROBE_ROWS = 256


def learner_precision(name: str, model, device: str, role: str, parallel: DataParallel | None = None) -> Precision:
    """`policy.compute.precision` or `critic.compute.precision` for `model`
    (`asyncrl.models.precision.choose_precision` at `LEARNER_PROBE_ROWS` rows). The ranks of a sharded
    learner decide on their timings summed, so all take the same."""
    combine = None if parallel is None else (lambda fp32_s, bf16_s: tuple(
        parallel.sum({"fp32": fp32_s, "bf16": bf16_s})[k] for k in ("fp32", "bf16")))
    return choose_precision(name, model, device, LEARNER_PROBE_ROWS, role, combine)


def learner_backend(policy: PolicyConfig) -> str:
    return "nccl" if policy.compute.device == "cuda" else "gloo"
