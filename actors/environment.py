"""An environment as an endpoint of its own (a Ray actor of the run): it answers episodes' tool
calls (`asyncrl.environments`). The generators call it with a timeout and retries
(`EnvironmentClient`); a call that still fails comes back as an error observation, never a lost or
hung episode. Stateless, so Ray restarts a dead one and retries what it was answering."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import ray

from asyncrl.config import EnvironmentConfig
from asyncrl.environments.formats import ToolCall
from asyncrl.environments.tools import ENVIRONMENTS, Episode, LookupTool, PythonTool


def build_environment(config: EnvironmentConfig):
    if config.name == "python":
        return PythonTool(config.python_wall_s, config.python_memory_mb, config.max_observation_chars,
                          config.allow_unisolated)
    if config.name == "lookup":
        return LookupTool()
    raise ValueError(f"unknown environment {config.name!r}; expected one of {sorted(ENVIRONMENTS)}")


class EnvironmentEndpoint:
    def __init__(self, config: dict):
        self.config = EnvironmentConfig(**config)
        self.environment = build_environment(self.config)
        self.calls = 0

    async def step(self, name: str, arguments: dict, prompt_id: str, sample_idx: int) -> tuple[str, bool]:
        """One tool call of one episode: (observation text, error). Runs off the event loop (a
        sandboxed program takes a while), so calls are answered concurrently."""
        self.calls += 1
        return await asyncio.to_thread(self.environment.step, ToolCall(name, arguments), Episode(prompt_id, sample_idx))

    def stats(self) -> dict:
        return {"calls": self.calls, "environment": self.config.name}


def environment_actor(config: EnvironmentConfig, placement: dict | None = None) -> Any:
    return ray.remote(EnvironmentEndpoint).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                                   max_task_retries=3, **(placement or {})).remote(asdict(config))


class EnvironmentClient:
    """What a generator calls: the endpoint's `step` with the run's timeout and retries."""

    def __init__(self, endpoint: Any, timeout_s: float, retries: int):
        self.endpoint, self.timeout_s, self.retries = endpoint, timeout_s, retries

    async def __call__(self, call: ToolCall, episode: Episode) -> tuple[str, bool]:
        error = ""
        for _ in range(self.retries + 1):
            try:
                return await asyncio.wait_for(
                    self.endpoint.step.remote(call.name, call.arguments, episode.prompt_id, episode.sample_idx),
                    self.timeout_s)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
                error = f"{type(exc).__name__}"
        return f"the tool did not answer ({error} after {self.retries + 1} tries)", True
