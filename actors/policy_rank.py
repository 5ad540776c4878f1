"""Rank 1.. of a sharded policy learner (`policy.compute.ranks`): a process of its own that holds its share
of the weights, gradients and Adam's state, and runs each step with rank 0 (`actors.policy_learner`)."""

from __future__ import annotations

import os

import torch

from asyncrl.config import AlgorithmConfig, EngineConfig, ModelConfig, PolicyConfig, SamplingConfig
from asyncrl.learning.rank import build_policy_rank, learner_backend
from asyncrl.weights.sharding import join as join_ranks
from asyncrl.weights.sync import node_address


class PolicyRankActor:
    """Rank 1.. of a sharded policy learner: builds its model, meets the other ranks, and runs what
    rank 0 asks, in order (a sync actor: one call at a time)."""

    METHODS = ("step", "snapshot", "delivered", "state", "load")

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig,
                 sampling: SamplingConfig, seed: int, rendezvous: tuple[str, int], rank: int):
        compute = policy.compute
        torch.set_num_threads(compute.threads)
        self.rank = rank
        parallel = join_ranks(*rendezvous, compute.ranks, rank, learner_backend(policy), compute.timeout_s)
        self.inner, _ = build_policy_rank(model, algorithm, policy, engine, sampling, seed, parallel)

    def call(self, method: str, *args):
        if method not in self.METHODS:
            raise ValueError(f"a policy rank has no method {method!r}")
        return getattr(self.inner, method)(*args)

    def stats(self) -> dict:
        return {"rank": self.rank, "optimizer_steps": self.inner.optimizer_steps(), "node_ip": node_address()}

    def pid(self) -> int:
        return os.getpid()
