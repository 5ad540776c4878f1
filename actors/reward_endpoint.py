"""Reward endpoints as plain Ray actors of a run (`asyncrl train`); under `serve run` they are the
Serve applications `reward-<name>` instead (`reward.use_serve`). The endpoint itself (verifier,
generative judge, Bradley-Terry or process reward model) is `asyncrl.rewards.endpoint.RewardEndpoint`,
the same class the Serve application serves."""

from __future__ import annotations

from typing import Any

import msgspec
import ray

from asyncrl.config import ModelConfig, RewardConfig
from asyncrl.rewards.endpoint import RewardEndpoint


def reward_endpoint_actors(reward: RewardConfig, model: ModelConfig, default_style: str,
                           placement: dict | None = None) -> dict[str, Any]:
    """One actor per configured endpoint. Stateless: Ray restarts a dead endpoint and retries the
    calls it was answering."""
    return {
        name: ray.remote(RewardEndpoint).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                                 max_task_retries=3, **(placement or {})).remote(
            name, msgspec.to_builtins(endpoint), msgspec.to_builtins(model), default_style)
        for name, endpoint in reward.endpoints.items()
    }
