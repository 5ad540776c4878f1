"""What every role's Ray shell shares: the loop controls (run, stop, stats), and joining the weight
group (the learner and the generators on other nodes)."""

from __future__ import annotations

import os
from typing import Any

import ray

from asyncrl.weights.sync import WeightGroup, node_address


class TrainingLoop:
    """The loop controls of a role that trains (stop, the metrics it recorded since the last read)."""

    _running: bool = False
    _metrics: list[dict]

    def stop(self) -> None:
        self._running = False

    def pop_metrics(self) -> list[dict]:
        """Metrics recorded since the last call (the run drains them)."""
        out, self._metrics = self._metrics, []
        return out


class RoleShell:
    """A role's Ray actor: forwards the loop controls of the role object it holds in `inner`."""

    inner: Any

    async def run(self) -> None:
        await self.inner.run()

    def stop(self) -> None:
        self.inner.stop()

    def stats(self) -> dict:
        return {**self.inner.stats(), "node_ip": node_address()}  # where the role landed

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class WeightGroupMember:
    """A generator on another node than the learner meets it in a group of two (the learner rank 0)."""

    def init_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str = "gloo") -> None:
        self.inner.weight_group = WeightGroup(host, port, world_size, rank, backend, local_address=node_address())
