"""An environment as an endpoint of its own (a Ray actor of the run): it answers episodes' tool
calls (`asyncrl.environments`). Generators call it through `EnvironmentClient` (a timeout,
retries, an error observation when it still fails). Stateless, so Ray restarts a dead one and
retries what it was answering; `reconfigure` swaps its settings while the run trains."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import ray

from asyncrl.config import EnvironmentConfig
from asyncrl.environments.formats import ToolCall
from asyncrl.environments.tools import Episode, build_environment, step_answer


class EnvironmentEndpoint:
    def __init__(self, config: dict):
        self.config = msgspec.convert(config, EnvironmentConfig)
        self.environment = build_environment(self.config)
        self.calls = self.errors = 0
        self.fault_delay_s = 0.0  # load tests: a slow or hung environment

    async def step(self, name: str, arguments: dict, prompt_id: str, sample_idx: int) -> tuple[str, bool]:
        """One tool call of one episode: (observation text, error). Runs off the event loop (a
        sandboxed program takes a while), so calls are answered concurrently."""
        self.calls += 1
        if self.fault_delay_s:
            await asyncio.sleep(self.fault_delay_s)
        try:
            text, error = await asyncio.to_thread(step_answer, self.environment, ToolCall(name, arguments),
                                                  Episode(prompt_id, sample_idx))
        except Exception as exc:  # noqa: BLE001 - an environment that raises answers with why; the episode goes on
            text, error = f"error: {type(exc).__name__}: {exc}", True
        self.errors += int(error)
        return text, error

    def reconfigure(self, changes: dict) -> dict:
        """New settings (a field of `EnvironmentConfig`, or `fault_delay_s`), in place."""
        self.fault_delay_s = float(changes.pop("fault_delay_s", self.fault_delay_s))
        if changes:
            self.config = msgspec.convert({**msgspec.to_builtins(self.config), **changes}, EnvironmentConfig)
            self.environment = build_environment(self.config)
        return self.stats()

    def stats(self) -> dict:
        return {"calls": self.calls, "errors": self.errors,
                "environment": self.config.name or self.config.class_path}


def environment_actor(config: EnvironmentConfig, placement: dict | None = None) -> Any:
    return ray.remote(EnvironmentEndpoint).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                                   max_task_retries=3, **(placement or {})).remote(
        msgspec.to_builtins(config))
